"""Read a slice of a topic's history (between two timestamps, or from given offsets) without a consumer group.

Used by `forge-stream replay` and by analytics jobs: partitions are `assign()`ed, offsets are looked up with
`offsets_for_times`, nothing is ever committed, so live consumer groups are untouched. `read_completions` reads
Completions with their prompts rebuilt whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from confluent_kafka import Consumer

from forge_stream.events import DecodeError, decode
from forge_stream.events.prompts import whole_completions
from forge_stream.kafka.consumer import Event, event_of, low_high, offset_at_time
from forge_stream.kafka.reader import partition_records, records_between
from forge_stream.topics import TOPICS, Topic


@dataclass(frozen=True)
class Slice:
    """Which part of history: timestamps in epoch ms (inclusive start, exclusive end), or per-partition offsets."""

    start_ms: int | None = None
    end_ms: int | None = None
    start_offsets: dict[int, int] | None = None
    end_offsets: dict[int, int] | None = None


def _bounds(consumer: Consumer, topic: Topic, where: Slice) -> dict[int, tuple[int, int]]:
    bounds = {}
    for p in range(topic.partitions):
        low, high = low_high(consumer, topic.name, p)
        start, end = low, high
        if where.start_offsets is not None:
            start = max(low, where.start_offsets.get(p, low))
        elif where.start_ms is not None:
            start = offset_at_time(consumer, topic.name, p, where.start_ms)
        if where.end_offsets is not None:
            end = min(high, where.end_offsets.get(p, high))
        elif where.end_ms is not None:
            end = offset_at_time(consumer, topic.name, p, where.end_ms)
        if start < end:
            bounds[p] = (start, end)
    return bounds


def read_slice(bootstrap: str, topic: Topic, where: Slice, errors: list | None = None) -> Iterator[Event]:
    """Decoded events of `topic` in the slice, partition by partition; undecodable ones go to `errors`."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-history-reader",
                         "enable.auto.commit": False, "log_level": 0})
    try:
        for partition, (start, end) in sorted(_bounds(consumer, topic, where).items()):
            for msg in records_between(consumer, topic.name, partition, start, end, 10):
                try:
                    schema, record = decode(msg.value() or b"")
                except DecodeError as exc:
                    if errors is not None:
                        errors.append((partition, msg.offset(), str(exc)))
                    continue
                yield event_of(msg, schema, record)
    finally:
        consumer.close()


def read_completions(bootstrap: str, where: Slice = Slice(), keep: Callable[[dict], bool] = lambda r: True,
                     messages: bool = True) -> list[dict]:
    """The Completions in the slice that `keep` selects, each with its prompt ids (and messages) rebuilt whole
    (forge_stream.events.prompts). A prompt's reference is an earlier completion of its session, so `keep` must
    select whole sessions and the slice must start at or before their first completion."""
    kept = [e.record for e in read_slice(bootstrap, TOPICS.completions, where) if keep(e.record)]
    return whole_completions(kept, messages)


def topic_bytes(bootstrap: str, key_contains: bytes | None = None, include_internal: bool = False) -> dict[str, int]:
    """Bytes of keys and values held by every topic of the cluster (compacted topics as they are now), read
    without a consumer group, counting only records whose key contains `key_contains` when given (a group id:
    the rollout topics are keyed by it, and so are the processors' table changelogs); Kafka's own `__` topics
    only with `include_internal`. For benchmarks."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-history-reader",
                         "enable.auto.commit": False, "log_level": 0})
    try:
        topics = {name: meta for name, meta in consumer.list_topics(timeout=10).topics.items()
                  if include_internal or not name.startswith("__")}
        out = {name: 0 for name in sorted(topics)}
        for msg in partition_records(consumer, [(name, p) for name in out for p in topics[name].partitions], 10):
            key = msg.key() or b""
            if key_contains is None or key_contains in key:
                out[msg.topic()] += len(key) + len(msg.value() or b"")
    finally:
        consumer.close()
    return out
