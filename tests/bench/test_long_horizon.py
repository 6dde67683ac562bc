"""`forge-stream bench long-horizon` at toy size on the test broker: every turn goes through the real gateway and
processors, context resets make new branches, the group's sample comes back by claim check, and it trains. (The
figures of the full size are in docs/benchmarks/long-horizon.md; this checks the path and its accounting, not the
targets.)"""

import math

import pytest

from forge_stream.bench.long_horizon import run

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def test_a_small_long_horizon_group_goes_through_every_stage(kafka_bootstrap):
    out = run(bootstrap=kafka_bootstrap, sessions=2, turns=14, append_tokens=300, resets=(5,), half=False,
              train=True, claim_over_bytes=16 * 1024)
    assert out["calls"] == 28 and out["resets"] == 1
    assert out["max_context_tokens"] > 8 * 300  # nine appends since the reset, at least
    assert out["sample_schema"] == "SampleClaim" and out["claim_bytes"] > 16 * 1024  # stored by reference
    assert out["total_tokens"] > out["unique_tokens"] > out["max_context_tokens"]  # shared prefixes, two branches
    assert out["kafka_topics"]["forge.completions"] < out["unique_tokens"] * 8  # prompts by reference, not whole
    assert out["kafka_bytes"] == sum(out["kafka_topics"].values()) and "forge.samples" in out["kafka_topics"]
    assert out["trained"] and math.isfinite(out["loss"]) and out["grad_norm"] > 0  # rewards 0 and 1: a signal
    assert 0 < out["train_peak_rss_mb"] < 8000
    assert out["gateway_overhead_ms_p50_small"] is not None and out["gateway_overhead_ms_p50_long"] is not None
