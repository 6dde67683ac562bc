"""The torch engine follows a LoRA run: each adapter version (forge_stream.lora) is loaded onto its base model and
served labelled with its version; an adapter that cannot be read is skipped and the last version stays served."""

import time
import uuid

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from forge_stream import lora
from forge_stream.engine.shared.process import EngineProcess

from helpers import adapter_version, publish_adapter_version, until

pytestmark = pytest.mark.kafka


def _answer(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "logprobs": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.slow
def test_adapter_versions_are_served_under_their_version_and_a_corrupt_one_is_skipped(
        kafka_bootstrap, tiny_model_dir, tmp_path, reference_logprobs):
    run = f"lora-{uuid.uuid4().hex[:8]}"
    good = adapter_version(tiny_model_dir, tmp_path / "v1", seed=1)
    corrupt = adapter_version(tiny_model_dir, tmp_path / "v2", seed=2)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated file
    later = adapter_version(tiny_model_dir, tmp_path / "v3", seed=3)
    prompt = [5, 17, 99, 23, 42]
    log = tmp_path / "engine.log"
    with EngineProcess(str(tiny_model_dir), log_path=log,
                       extra_args=("--bootstrap-servers", kafka_bootstrap, "--policy-run", run,
                                   "--checkpoint-dir", str(tmp_path))) as engine:
        published = publish_adapter_version(kafka_bootstrap, run, 1, good)
        first = until(lambda: (a := _answer(engine.url, prompt))["policy_version"] == 1 and a, 60,
                      "version 1 not served")
        took = time.monotonic() - published
        print(f"torch engine: adapter version 1 ({lora.weight_bytes(good)} bytes) published -> first answer under it "
              f"in {took:.2f}s")
        publish_adapter_version(kafka_bootstrap, run, 2, corrupt)
        until(lambda: f"policy version 2 at {corrupt} is not served" in log.read_text(), 60,
              "the corrupt version was not rejected")
        kept = _answer(engine.url, prompt)
        publish_adapter_version(kafka_bootstrap, run, 3, later)
        until(lambda: _answer(engine.url, prompt)["policy_version"] == 3, 60, "version 3 not served")

    assert kept["policy_version"] == 1
    peft = lora.load_policy(good, merge=False).eval()
    for answer in (first, kept):  # what the engine served is the adapter's policy, as peft computes it
        choice = answer["choices"][0]
        expected = reference_logprobs(peft, prompt, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with torch.no_grad():
        assert not torch.allclose(peft(torch.tensor([prompt])).logits, base(torch.tensor([prompt])).logits,
                                  atol=1e-3)
