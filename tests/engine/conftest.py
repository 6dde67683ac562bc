"""Fixtures of the engine tests: the tiny model (built once) and one engine server process."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.engine.process import EngineProcess
from forge_stream.engine.tiny import TinyModelSpec, init_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    init_tiny_model(out, TinyModelSpec(seed=0))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir_v1(tmp_path_factory) -> Path:
    """Same tokenizer and shapes, other weights: stands in for the next policy version."""
    out = tmp_path_factory.mktemp("tiny_v1") / "model"
    init_tiny_model(out, TinyModelSpec(seed=0))
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out


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
