"""Benchmarks behind `forge-stream bench`; each module exposes `run(...) -> dict`.

A benchmark that needs Kafka starts a broker of its own (`bench_kafka`) unless it is given one: probes and
load never land on whatever cluster the default bootstrap would reach, such as a user's live deployment.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path


@contextmanager
def bench_kafka(bootstrap: str | None, workdir: Path):
    """`bootstrap` if given (its catalog topics created), else a fresh local broker in `workdir` for the run."""
    from forge_stream.kafka.admin import check_topics, create_topics
    from forge_stream.kafka.broker import BrokerConfig, LocalBroker, free_port
    from forge_stream.settings import ForgeSettings

    if bootstrap:
        create_topics(bootstrap)
        check_topics(bootstrap)
        yield bootstrap
        return
    broker = LocalBroker(BrokerConfig(workdir / "kafka", ForgeSettings().cache_dir, port=free_port(),
                                      controller_port=free_port()))
    try:  # stopped even when the run ends while the broker still starts (a SIGTERM: see forge_stream.cli.bench)
        started = broker.start(echo=lambda *_: None)
        create_topics(started)
        yield started
    finally:
        broker.stop()
