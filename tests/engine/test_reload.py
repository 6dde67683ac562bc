"""Weight reload over HTTP while a request streams: it finishes on the old version and says so."""

import json

import httpx
import pytest
from transformers import AutoModelForCausalLM

from forge_stream.engine.shared.process import EngineProcess

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]


@pytest.mark.slow
def test_reload_mid_stream_keeps_old_version_for_in_flight_request(tiny_model_dir, tiny_model_dir_v1,
                                                                  reference_logprobs):
    body = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, "logprobs": True, "return_token_ids": True,
            "ignore_eos": True, "stream": True}
    with EngineProcess(str(tiny_model_dir), extra_args=("--checkpoint-dir", str(tiny_model_dir_v1.parent))) as engine, \
            httpx.Client(base_url=engine.url, timeout=60) as client:
        chunks = []
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = (line[6:] for line in stream.iter_lines() if line.startswith("data: "))
            chunks.append(json.loads(next(lines)))
            reload = client.post("/v1/admin/load_weights", json={"path": str(tiny_model_dir_v1), "version": 1})
            assert reload.status_code == 200, reload.text
            assert reload.json()["previous_version"] == 0
            chunks += [json.loads(line) for line in lines if line != "[DONE]"]
        after = client.post("/v1/chat/completions", json={**body, "stream": False}).json()
        models = client.get("/v1/models").json()

    tokens = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert len(tokens) == 80
    assert {c["policy_version"] for c in chunks} == {0}
    assert after["policy_version"] == 1 and models["data"][0]["policy_version"] == 1
    prompt = chunks[0]["prompt_token_ids"]
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir_v1).eval()
    ids = after["choices"][0]["token_ids"]
    got = [lp["logprob"] for lp in after["choices"][0]["logprobs"]["content"]]
    assert got == pytest.approx(reference_logprobs(new_model, prompt, ids), abs=1e-4)
