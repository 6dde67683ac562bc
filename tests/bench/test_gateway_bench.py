"""`forge-stream bench gateway` at toy size on the test broker: both phases answer every call, every answered call
through the gateway is a Completion on Kafka, and each process's CPU is accounted. (The figures of the full size
are in docs/benchmarks/gateway.md; this checks the path and its accounting, not the target.)"""

import pytest

from forge_stream.bench.gateway import run

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_gateway_bench_records_every_call_and_accounts_each_process(kafka_bootstrap, workers):
    # two workers: callers reconnect for every phase, so sessions move between the workers (and are caught up)
    out = run(requests=300, concurrency=(1, 8), bootstrap=kafka_bootstrap, workers=workers, reconnect=workers == 2)
    assert out["recorded_events_checked"]  # as many new Completions on the topic as calls answered
    for phases in out["concurrency"].values():
        assert phases["direct"]["errors"] == phases["gateway"]["errors"] == 0
        assert phases["gateway"]["p50_ms"] > 0 and phases["direct"]["per_s"] > 0
    through = out["cpu_ms_per_request"]["through_gateway"]
    assert through["gateway"] > 0 and through["engine"] > 0 and through["client"] > 0
    assert "broker" not in through  # a broker it was given is not its own to measure
    # direct, the gateway idles: its background threads may cross one or two of /proc's 10 ms ticks in a short phase
    assert through["machine"] > 0 and out["cpu_ms_per_request"]["direct"]["gateway"] < through["gateway"] / 4
    assert 0 < out["gateway_to_engine"] and out["workers"] == workers and out["reconnect"] == (workers == 2)
    # three rounds at the top concurrency (every gateway call of each counted above); the median round is reported
    ratios = [r["gateway_to_engine"] for r in out["rounds"]]
    assert len(ratios) == 3 and out["gateway_to_engine"] == sorted(ratios)[1]
    reported = round(out["concurrency"]["8"]["gateway"]["per_s"])  # the median round's (ratios may tie at 3 places)
    assert any(r["gateway_to_engine"] == out["gateway_to_engine"] and r["recorded_per_s"] == reported
               for r in out["rounds"])
    assert out["sessions_shared_by"] == ("ledger" if workers == 2 else None)


def test_the_gateway_bench_floor_measures_a_pass_through_with_and_without_kafka(kafka_bootstrap):
    """`--floor`: the pass-through proxy answers every call, its acknowledged phase writes one record per call to a
    scratch topic (the plain one none), and the topic is gone after the run."""
    from forge_stream.kafka.admin import admin_client

    out = run(requests=300, concurrency=(8,), bootstrap=kafka_bootstrap, workers=2, floor=True)
    plain, acked = out["floor"]["pass_through"], out["floor"]["pass_through_acked"]
    for phase in (plain, acked):
        assert phase["errors"] == 0 and phase["requests"] == 296 and phase["to_engine"] > 0  # 8 callers x 37
        assert phase["cpu_ms_per_request"]["pass_through"] > 0 and "gateway" not in phase["cpu_ms_per_request"]
    assert acked["records_checked"] and "records_checked" not in plain
    topics = admin_client(kafka_bootstrap).list_topics(timeout=10).topics
    assert not [name for name in topics if name.startswith("forge-bench.pass-through")]
