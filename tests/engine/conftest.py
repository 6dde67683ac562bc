"""Fixtures of the engine tests: its tokenizer and reference model, and one engine server process (started in the
background as the session begins: tests/early.py)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.engine.shared.process import EngineProcess

from early import EARLY

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _engine(get):
    log = get("tmp_path_factory").mktemp("engine_log") / "engine.log"
    return EngineProcess(str(get("tiny_model_dir")), extra_args=("--max-batch-size", "8"), log_path=log).start


EARLY.declare("engine_url", lambda item: item.path.parent == HERE and "engine_url" in item.fixturenames, _engine,
              stop=EngineProcess.stop)


@pytest.fixture(scope="session")
def engine_url(request):
    """Started in the background from the session's start (tests/early.py)."""
    proc = EARLY.take("engine_url", request.getfixturevalue)
    try:
        yield proc.url
    finally:
        proc.stop()


def _reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Logprobs of the completion tokens from one plain transformers forward over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(completion_ids)]


@pytest.fixture(scope="session")
def reference_logprobs():
    return _reference_logprobs
