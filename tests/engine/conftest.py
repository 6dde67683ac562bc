"""Fixtures of the engine tests: its tokenizer and reference model, and one engine server process."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.engine.process import EngineProcess


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


@pytest.fixture(scope="session")
def engine_url(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine_log") / "engine.log"
    with EngineProcess(str(tiny_model_dir), extra_args=("--max-batch-size", "8"), log_path=log) as proc:
        yield proc.url


def _reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Logprobs of the completion tokens from one plain transformers forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion_ids)]


@pytest.fixture(scope="session")
def reference_logprobs():
    return _reference_logprobs
