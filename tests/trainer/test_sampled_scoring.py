"""The policy trained is the policy sampled: completions the torch engine sampled at temperature 0.7 (some with top_p
0.9), recorded by the gateway on the real broker and folded into a TrainSample by the processors, are scored by the
trainer step at the serving weights with the log-probs the engine recorded (fp32).

One kind of token may differ, and by a known amount: a token at the nucleus's edge. The engine's cached, batched
forward and the trainer's tree forward agree to about 5e-6 nats, so a token whose cumulative mass sits within that
of 1 - top_p can fall inside the nucleus for one and outside for the other, and the renormalised log-probs of its
row then differ by about that token's mass (tiny model, 2,048 tokens, nearly flat: 5e-4 nats). Such a token is told
apart by rescoring at a top_p 2e-5 either side (helpers.nucleus_edge): there the trainer's nucleus is the engine's
again."""

import math
import uuid

import httpx
import pytest
import torch
from helpers import folded_train_sample, nucleus_edge, serving, trainer_gaps
from transformers import AutoModelForCausalLM

from forge_stream.engine.shared.process import EngineProcess
from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings

pytestmark = pytest.mark.kafka

ASK = [{"role": "user", "content": "What is 347 + 518?"}]
MATCH = 1e-4  # nats: trainer against engine, at the same weights and settings


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, kafka_bootstrap, tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EngineProcess(str(tiny_model_dir), extra_args=("--max-batch-size", "8"), log_path=log) as engine, \
            serving(create_app(GatewaySettings(engines=(engine.url,), bootstrap=kafka_bootstrap))) as url:
        yield url


def sampled_group(gateway: str, group_id: str, settings: list[dict]) -> None:
    """One session per entry of `settings`, each a 32-token answer sampled at them, rewarded 1 or 0 in turn."""
    for i, sampling in enumerate(settings):
        opened = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": "sum"})
        assert opened.status_code == 201, opened.text
        session = opened.json()
        answer = httpx.post(f"{session['base_url']}/chat/completions", timeout=120, json={
            "model": "tiny", "messages": ASK, "max_tokens": 32, "seed": i, **sampling})
        assert answer.status_code == 200, answer.text
        for path, body in (("reward", {"value": float(i % 2)}), ("finish", {"status": "ok"})):
            assert httpx.post(f"{gateway}/v1/sessions/{session['session_id']}/{path}", json=body).status_code == 200


@pytest.mark.slow
def test_tokens_sampled_at_a_temperature_and_top_p_are_scored_as_the_engine_recorded_them(
        gateway, tiny_model_dir, kafka_bootstrap):
    """Measured: max |trainer - recorded| 5.2e-6 nats over 192 tokens (ratio max 1 + 4e-6; the engine's cached,
    batched forward against the trainer's tree forward); scored at temperature 1, as the trainer once did, 1.41 nats.
    CI once measured 5.1e-4 on one token: a nucleus-edge token (module docstring)."""
    group_id = f"hot-{uuid.uuid4().hex[:8]}"
    settings = [{"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9}] * 3
    sampled_group(gateway, group_id, settings)
    sample = folded_train_sample(kafka_bootstrap, group_id, len(settings))
    assert sorted((s["temperature"], s["top_p"]) for s in sample["sequences"]) == [(0.7, 0.9)] * 3 + [(0.7, 1.0)] * 3
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    stats, at_one = trainer_gaps(model, sample)
    gaps, edge = nucleus_edge(model, sample, MATCH)
    print(f"\ntorch engine, tiny model: {stats['tokens']} tokens at T=0.7 (half with top_p 0.9): max |trainer - "
          f"recorded| {stats['mismatch_max']:.1e} nats, ratio max {stats['ratio_max']:.7f}; at T=1 {at_one:.2f}; "
          f"{int(edge.sum())} at the nucleus's edge, max off it {float(gaps[~edge].max()):.1e}")
    assert stats["tokens"] == len(gaps) > 60
    assert float(gaps[~edge].max()) < MATCH  # every token off the edge as recorded
    assert int(edge.sum()) <= 3, gaps[edge]  # seeds fixed: 4 runs in 14 here met one such token, 5.1e-4 off
    worst = max(MATCH, float(gaps.max()))  # the step scores as path_logprobs does, edge tokens included
    assert stats["mismatch_max"] < worst + 1e-6 and stats["ratio_max"] < math.exp(worst + 1e-6)
    assert at_one > 0.05
