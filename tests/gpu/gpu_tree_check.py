"""GPU check (run by hand on a CUDA machine; needs only torch + transformers and this repository):

    PYTHONPATH=$PWD python tests/gpu/gpu_tree_check.py [--quick]

1. Accuracy: bf16 tree (compiled flex_attention, BlockMask built once per batch) and bf16 per-sequence SDPA,
   both against a float32 per-sequence reference of the same weights; target about 1e-2 max log-prob difference.
2. Speed: one training step (forward + backward) tree vs unshared padded SDPA batches on workloads (a)-(c)
   of `forge-stream bench prefix-tree`, bf16, with peak CUDA memory. Prints one JSON object.

The functions take a device, so their CPU-portable parts run in tests/gpu/test_gpu_check_portable.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace

import torch

from forge_stream.bench.prefix_tree import QUICK, BenchSettings, baseline_step, tree_step, workloads
from forge_stream.tree import pack, sequence_logprobs
from forge_stream.tree.reference import padded_logprobs, tiny_causal_lm

GPU_SETTINGS = replace(BenchSettings(), hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, vocab_size=32000)


def build_models(s: BenchSettings, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The float32 reference model and a `dtype` copy with the same weights, both on `device`."""
    ref = tiny_causal_lm(
        "llama", vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_layers=s.num_layers,
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, seed=s.seed,
    ).to(device)  # fmt: skip
    return ref, copy.deepcopy(ref).to(dtype)


def accuracy(s: BenchSettings, device: str, dtype: torch.dtype, backend: str = "auto") -> dict:
    """Per workload: max |log-prob - float32 reference| for the tree and for per-sequence SDPA in `dtype`."""
    ref_model, model = build_models(s, device, dtype)
    out = {}
    with torch.no_grad():
        for name, seqs in workloads(s).items():
            ref = torch.cat(padded_logprobs(ref_model, seqs, batch_tokens=s.batch_tokens))
            tree = torch.cat(sequence_logprobs(model, pack(seqs), backend=backend)).float()
            base = torch.cat(padded_logprobs(model, seqs, batch_tokens=s.batch_tokens)).float()
            out[name] = {
                "tree_vs_fp32": float((tree - ref).abs().max()),
                "sdpa_vs_fp32": float((base - ref).abs().max()),
                "tree_vs_sdpa": float((tree - base).abs().max()),
            }
    return out


def _timed(fn, device: str, repeats: int) -> tuple[float, float]:
    """Best wall time of `repeats` calls after one warm-up (compiles flex), and peak CUDA memory in MiB."""
    fn()
    best = float("inf")
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    return best, peak


def speed(s: BenchSettings, device: str, dtype: torch.dtype, repeats: int = 3) -> list[dict]:
    """Per workload: T, U, step time and peak memory of tree and baseline, speedup."""
    _, model = build_models(s, device, dtype)
    rows = []
    for name, seqs in workloads(s).items():
        packed = pack(seqs)
        weights = torch.randn(len(seqs), generator=torch.Generator().manual_seed(s.seed + 1)).tolist()
        times = {}
        for variant, step in (("tree", tree_step), ("baseline", baseline_step)):
            model.zero_grad(set_to_none=False)
            times[variant] = _timed(lambda: step(model, seqs, weights, s), device, repeats)
        ratio = packed.total_tokens / packed.num_rows
        rows.append(
            {
                "name": name, "T": packed.total_tokens, "U": packed.num_rows, "T_over_U": round(ratio, 3),
                "tree_step_s": times["tree"][0], "baseline_step_s": times["baseline"][0],
                "speedup": times["baseline"][0] / times["tree"][0],
                "tree_peak_mb": times["tree"][1], "baseline_peak_mb": times["baseline"][1],
            }
        )  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model and workloads")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tree_check.py needs a CUDA device")
    s = QUICK if args.quick else GPU_SETTINGS
    result = {
        "device": torch.cuda.get_device_name(),
        "settings": {"hidden_size": s.hidden_size, "num_layers": s.num_layers, "vocab_size": s.vocab_size},
        "accuracy_bf16": accuracy(s, "cuda", torch.bfloat16),
        "workloads": speed(s, "cuda", torch.bfloat16),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
