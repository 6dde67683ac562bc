"""The probe both engines run on a new version (forge_stream.engine.shared.probe): its tolerance follows the served
dtype, so that bfloat16's rounding passes where another version's weights do not, and log-probs that are not finite
never match. Real models: the tiny model's log-probs in bfloat16 against its own in float32 (two implementations
rounding differently, as vLLM's kernels and transformers do)."""

import math

import torch
from transformers import AutoModelForCausalLM

from forge_stream.engine.shared.probe import model_logprobs, probe_ids, tolerance, worst_difference


def _logprobs(folder, dtype: torch.dtype) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    return model_logprobs(model, probe_ids(model.config.vocab_size))


def test_the_probe_tolerance_follows_the_dtype(tiny_model_dir, tiny_model_dir_v1):
    float32 = _logprobs(tiny_model_dir, torch.float32)
    rounded = _logprobs(tiny_model_dir, torch.bfloat16)
    worst, problem = worst_difference(rounded, float32, "bfloat16")
    assert problem is None and worst > tolerance("float32")  # a fixed float32 tolerance would refuse bfloat16
    assert "the float32 tolerance" in worst_difference(rounded, float32, "float32")[1]
    worst, problem = worst_difference(_logprobs(tiny_model_dir_v1, torch.bfloat16), float32, "bfloat16")
    assert problem is not None and worst > tolerance("bfloat16")  # another version's weights still do not pass


def test_log_probs_that_are_not_finite_never_match(tiny_model_dir):
    float32 = _logprobs(tiny_model_dir, torch.float32)
    for bad in (math.nan, -math.inf):
        worst, problem = worst_difference([bad, *float32[1:]], float32, "bfloat16")
        assert worst == math.inf and "not finite at 1 of" in problem
