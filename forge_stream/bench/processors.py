"""Benchmark: push N synthetic groups through a processors worker and time them to their samples.

Runs on a Kafka broker of its own unless given one (`--bootstrap-servers`): its probe groups never land in a
live deployment's topics. Starts the topology as a worker process (its own app id, reading from the latest offsets), waits until a probe
group comes out of it, then produces the N groups as fast as the producer goes and reads forge.samples.
Reports groups per second (first event sent to last sample read) and the latency from a group's last event
(acknowledged by Kafka) to its sample on forge.samples.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from forge_stream import proc
from forge_stream.bench import bench_kafka
from forge_stream.events import now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.reader import Tail
from forge_stream.processors.synthetic import group_events
from forge_stream.topics import TOPICS

SCHEMA_TOPIC = {"Task": TOPICS.tasks, "SessionStarted": TOPICS.sessions, "SessionFinished": TOPICS.sessions,
                "Completion": TOPICS.completions, "ToolSpan": TOPICS.tool_spans, "Reward": TOPICS.rewards}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class _Samples:
    """Reads forge.samples from its end offsets; remembers when each group's sample was first written (the
    record's CreateTime, stamped by the worker's producer, so arrival does not depend on when we poll)."""

    def __init__(self, bootstrap: str):
        self.tail = Tail(bootstrap, TOPICS.samples)
        self.arrived: dict[str, float] = {}

    def wait_for(self, group_ids: set[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not group_ids <= self.arrived.keys() and time.monotonic() < deadline:
            event = self.tail.poll(0.2)
            if event is not None:
                self.arrived.setdefault(event.record["group_id"], event.timestamp_ms / 1000)
        return group_ids <= self.arrived.keys()


def _produce(producer: EventProducer, group_id: str, seq: int, group_size: int, turns: int,
             acked: dict[str, float], lock: threading.Lock) -> None:
    events = group_events(group_id, seq=seq, group_size=group_size, turns=turns, start_ms=now_ms())
    for i, (schema, record) in enumerate(events):
        last = i == len(events) - 1

        def done(err, msg, last=last):
            if last and err is None:
                with lock:
                    acked[group_id] = time.time()
        producer.produce(SCHEMA_TOPIC[schema], group_id, record, schema, on_delivery=done)


def run(bootstrap: str | None = None, groups: int = 200, group_size: int = 4, turns: int = 3,
        timeout_s: float = 300.0, rate: float | None = None) -> dict:
    """Push `groups` groups (all at once, or `rate` groups per second) and time each one's sample, on `bootstrap`
    or (by default) a broker of the benchmark's own."""
    with tempfile.TemporaryDirectory(prefix="forge-bench-processors-") as tmp, \
            bench_kafka(bootstrap, Path(tmp)) as kafka:
        result = _measure(kafka, groups, group_size, turns, timeout_s, rate)
    return {**result, "kafka": bootstrap or "the benchmark's own broker"}


def _measure(bootstrap: str, groups: int, group_size: int, turns: int, timeout_s: float,
             rate: float | None) -> dict:
    run_id = uuid.uuid4().hex[:8]
    samples = _Samples(bootstrap)
    producer = EventProducer(bootstrap)
    acked: dict[str, float] = {}
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as data_dir:
        worker = None
        probes = itertools.count()

        def probe() -> bool:
            """Whether a probe group comes through (the worker has its partitions and runs)."""
            gid = f"bench-{run_id}-probe{next(probes)}"
            _produce(producer, gid, -1, group_size, turns, acked, lock)
            producer.flush()
            return samples.wait_for({gid}, 3.0)

        try:
            worker = proc.start_process(
                [sys.executable, "-c", "from forge_stream.cli import main; main()", "processors", "run",
                 "-b", bootstrap, "--data-dir", data_dir, "--app-id", f"bench-processors-{run_id}",
                 "--offset-reset", "latest", "-l", "warning"],
                Path(data_dir) / "worker.log")
            proc.wait_healthy("the processors worker", worker, check=probe, log=Path(data_dir) / "worker.log",
                              timeout=180, interval=0)
            ids = [f"bench-{run_id}-{i}" for i in range(groups)]
            start = time.time()
            for seq, gid in enumerate(ids):
                if rate:
                    time.sleep(max(0.0, start + seq / rate - time.time()))
                _produce(producer, gid, seq, group_size, turns, acked, lock)
            producer.flush()
            if not samples.wait_for(set(ids), timeout_s):
                raise RuntimeError(f"only {len(set(ids) & samples.arrived.keys())}/{groups} samples arrived")
        finally:
            if worker is not None:
                proc.stop(worker, 30)
            producer.close()
            samples.tail.close()
    latencies = [(samples.arrived[g] - acked[g]) * 1000 for g in ids]
    elapsed = max(samples.arrived[g] for g in ids) - start
    return {
        "groups": groups, "group_size": group_size, "turns": turns, "offered_rate": rate or "all at once",
        "groups_per_s": groups / elapsed, "elapsed_s": elapsed,
        "latency_p50_ms": _percentile(latencies, 0.5), "latency_p99_ms": _percentile(latencies, 0.99),
        "latency_max_ms": max(latencies),
    }
