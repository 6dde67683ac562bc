"""The trainer takes what comes: one step on a very long path stays within memory linear in its rows, and the
chunked log-prob path (completion rows only, LM head in row chunks, checkpointed layers) is exact.

Memory of a step, by construction: each decoder layer's input kept for backward and one layer's activations at
a time (`StepConfig.checkpoint_layers`), one attention chunk's keys and mask (chunk x depth, freed after the
chunk) and `head_rows` x vocab logits. Nothing is U x U or U x vocab. The bound checked is 300 MB (thread
pools, allocator slack, AdamW state, one LM-head chunk) plus 32 KB per row: the tiny model's step measures
59 MB over its baseline at 3,000 rows and 255 MB at 9,000 (about 28 KB per row at the margin). The model has the
tiny model's sizes (`TinyModelSpec`).

The test's default path has 6,000 tokens (about 2 minutes on two busy cores): attention over one path costs
about L^2 / 2 (query, key) pairs per layer and head, and a 200K path (2e10 pairs) takes about half an hour
on two CPU cores (the long-horizon bench's two 216K paths: 62 minutes).
FORGE_LONG_PATH_TOKENS=200000 runs the full length under the same bound (6.7 GB); so does this file as a
script, which prints the measurement as JSON:

    nice -n 19 python tests/trainer/test_long_path.py 199000 1000
"""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from forge_stream.tiny.model import TinyModelSpec
from forge_stream.trainer.step import StepConfig, build_optimizer, train_step
from forge_stream.tree import pack
from forge_stream.tree.logprobs import path_logprobs
from forge_stream.tree.reference import separate_logprobs, tiny_causal_lm

ROOT = Path(__file__).resolve().parents[2]  # the checkout the test runs from, not an installed copy
COMPLETION = 1000
BYTES_PER_ROW = 32_000
FIXED_BYTES = 300 << 20


def long_path_sample(prompt: int, completion: int, seed: int = 0) -> dict:
    """A TrainSample-shaped dict of one group with one path: `prompt` random tokens, then `completion` trained."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 2048, (prompt + completion,), generator=gen).tolist()
    tree = pack([tokens])
    old = (-torch.rand(completion, generator=gen) * 3 - 6).tolist()
    ref = {"completion_id": "c0", "session_id": "s0", "turn": 0, "last_row": int(tree.last_row[0]),
           "length": prompt + completion, "prompt_len": prompt, "old_logprobs": old, "advantage": 1.0,
           "reward": 1.0, "policy_version": 0, "rollout": "s0", "outcome_reward": 1.0, "temperature": 1.0,
           "top_p": 1.0, "logprobs_mode": "processed"}
    return {"event_id": "g0", "group_id": "g0", "policy_version": 0, "token_ids": tree.token_ids.tolist(),
            "position_ids": tree.position_ids.tolist(), "subtree_end": tree.subtree_end.tolist(),
            "parent_row": tree.parent_row.tolist(), "sequences": [ref]}


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def measure_step(prompt: int, completion: int) -> dict:
    """One CISPO step on a `prompt + completion`-token path in this process: time, loss, grad norm and the
    step's peak memory over what the process held before it (VmHWM - VmRSS)."""
    spec = TinyModelSpec()
    model = tiny_causal_lm(spec.arch, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                           intermediate_size=spec.intermediate_size, num_layers=spec.num_layers,
                           num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                           max_positions=prompt + completion)
    sample = long_path_sample(prompt, completion)
    config = StepConfig(lr=1e-3)
    optimizer = build_optimizer(model, config)
    before = _status_bytes("VmRSS")
    start = time.monotonic()
    stats = train_step(model, optimizer, [sample], config, policy_version=0)
    return {"rows": prompt + completion, "seconds": round(time.monotonic() - start, 1), "loss": stats.loss,
            "grad_norm": stats.grad_norm, "loss_tokens": stats.loss_tokens, "rss_before": before,
            "peak": _status_bytes("VmHWM"), "step_bytes": _status_bytes("VmHWM") - before}


@pytest.mark.slow
def test_one_step_on_a_long_path_is_finite_in_memory_linear_in_its_rows():
    rows = int(os.environ.get("FORGE_LONG_PATH_TOKENS", "6000"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(rows - COMPLETION), str(COMPLETION)],
                          capture_output=True, text=True, timeout=36000, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rows"] == rows and out["loss_tokens"] == COMPLETION
    assert math.isfinite(out["loss"]) and out["loss"] != 0.0
    assert math.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert out["step_bytes"] < FIXED_BYTES + BYTES_PER_ROW * rows, out


def _completion_rows(tree, prompt_lens):
    return torch.cat([path[p:] for path, p in zip(tree.paths, prompt_lens)])


def test_completion_rows_in_head_chunks_equal_full_logits_and_unchunked_gradients():
    """path_logprobs on the completion rows only (repeated rows included), with small attention and LM-head
    chunks and checkpointed decoder layers, equals full-logit separate passes (float64, 1e-10) and the same tree
    scored unchunked, values and every parameter gradient."""
    gen = torch.Generator().manual_seed(11)
    trunk = torch.randint(0, 128, (300,), generator=gen).tolist()
    seqs = [trunk + [1, 2, 3], trunk[:150] + [4] * 40, trunk + [1, 2, 3], trunk[:299] + [5, 6], [7, 8, 9]]
    prompt_lens = [300, 120, 301, 200, 1]
    tree = pack(seqs)
    rows = _completion_rows(tree, prompt_lens)
    model = tiny_causal_lm("qwen2", dtype=torch.float64, seed=12)
    weights = torch.randn(rows.numel(), generator=gen, dtype=torch.float64)

    def scored(**chunks):
        model.zero_grad()
        lp = path_logprobs(model, tree, rows, **chunks)
        (weights * lp).sum().backward()
        return lp.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    chunked, chunked_grads = scored(chunk_rows=16, head_rows=7, checkpoint_layers=True)
    whole, whole_grads = scored(chunk_rows=tree.num_rows, head_rows=tree.num_rows)
    with torch.no_grad():
        full = torch.cat([lp[p - 1:] for lp, p in zip(separate_logprobs(model, seqs), prompt_lens)])
    assert chunked.shape == (sum(len(s) - p for s, p in zip(seqs, prompt_lens)),)
    assert float((chunked - full).abs().max()) < 1e-10
    assert float((chunked - whole).abs().max()) < 1e-12
    for name, g in whole_grads.items():
        rel = float((chunked_grads[name] - g).abs().max()) / max(float(g.abs().max()), 1e-30)
        assert rel < 1e-10, (name, rel)


if __name__ == "__main__":
    print(json.dumps(measure_step(int(sys.argv[1]), int(sys.argv[2]))))
