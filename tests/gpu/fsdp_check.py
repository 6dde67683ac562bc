"""GPU check of the distributed trainer (run by hand on a machine with CUDA GPUs; not collected by pytest):

    PYTHONPATH=$PWD torchrun --standalone --nproc-per-node 2 tests/gpu/fsdp_check.py

Each rank takes the steps of tests/trainer/test_distributed.py twice on its GPU, float32: once as plain data
parallelism over NCCL and once with the model sharded by FSDP (`fully_shard`, forge_stream.trainer.distributed);
rank 0 also takes them single-process. Prints one JSON line per mode with the max |parameter difference| from
the single-process run after each step; the target is about 1e-5 (float32, other reduction orders).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "trainer")]

from test_distributed import CONFIG, _batches  # noqa: E402

from forge_stream.trainer.distributed import from_env, shard_model  # noqa: E402
from forge_stream.trainer.step import build_optimizer, train_step  # noqa: E402
from forge_stream.tree.reference import tiny_causal_lm  # noqa: E402


def run(ranks=None, fsdp=False, device="cuda") -> list[dict]:
    model = tiny_causal_lm("qwen2", dtype=torch.float32, seed=7).to(device)
    if fsdp:
        shard_model(model)
    elif ranks is not None:
        ranks.sync_parameters(model)
    optimizer = build_optimizer(model, CONFIG)
    out = []
    for samples in _batches():
        train_step(model, optimizer, samples, CONFIG, policy_version=5, ranks=ranks)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=fsdp))
        out.append({k: v.detach().float().cpu() for k, v in state.items()})
    return out


def main() -> None:
    ranks = from_env()
    reference = run(device=ranks.device) if ranks.is_main else None
    for mode in ("data_parallel", "fsdp"):
        fsdp = mode == "fsdp"
        steps = run(replace(ranks, fsdp=fsdp), fsdp=fsdp, device=ranks.device)
        if ranks.is_main:
            diffs = [max(float((s[k] - r[k]).abs().max()) for k in r) for s, r in zip(steps, reference)]
            print(json.dumps({"mode": mode, "world_size": ranks.world_size, "max_param_diff_per_step": diffs}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
