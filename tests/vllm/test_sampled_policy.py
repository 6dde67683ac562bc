"""The distribution the trainer scores tokens under is vLLM's own: forge_stream.sampled_policy against vLLM 0.32's
sampler functions (temperature, then its top-p rule, then processed log-probs), run in the project's vLLM runtime."""

import subprocess

import pytest
import torch

from forge_stream.engine.vllm_front.runtime import runtime
from forge_stream.sampled_policy import processed_logits
from forge_stream.settings import ForgeSettings

pytestmark = pytest.mark.slow  # vLLM's own code, imported in its runtime: half a minute on 2 cores

VLLM_PROCESSED = """
import sys
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
from vllm.v1.sample.sampler import Sampler

given = torch.load(sys.argv[1])
logits = Sampler.apply_temperature(given["logits"].clone(), given["temperature"], all_random=True)
logits = apply_top_k_top_p(logits, None, given["top_p"])
torch.save(logits.log_softmax(dim=-1, dtype=torch.float32), sys.argv[2])
"""


def test_the_nucleus_and_processed_log_probs_are_vllms(tmp_path):
    """64 rows of a SmolLM2-sized vocabulary at temperature 0.7 and top_p from 0.5 to 0.99: the same tokens are
    cut, and the log-probs of the rest agree. (The torch engine's earlier rule, the same in exact arithmetic but
    summing from the most likely token down in float32, cut other tail tokens than vLLM on 107 of 2,560 such rows
    at top_p 0.9 and 0.95.)"""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 49152, generator=gen) * 3
    temperature = torch.full((64,), 0.7)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99] * 16)
    torch.save({"logits": logits, "temperature": temperature, "top_p": top_p}, tmp_path / "in.pt")
    python = runtime(ForgeSettings().cache_dir).python
    done = subprocess.run([str(python), "-c", VLLM_PROCESSED, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = torch.load(tmp_path / "out.pt")
    ours = torch.log_softmax(processed_logits(logits, temperature, top_p), dim=-1)
    kept = torch.isfinite(ours)
    assert torch.equal(kept, torch.isfinite(theirs))
    assert (~kept).sum(-1).min() > 0  # every row lost its tail
    assert float((ours[kept] - theirs[kept]).abs().max()) < 1e-6
