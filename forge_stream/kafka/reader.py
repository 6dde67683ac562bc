"""Reads of partitions outside any consumer group: nothing is committed, live groups are untouched.

`PartitionReader` reads one partition's records between two offsets (or from a timestamp), through a small pool of
consumers so that concurrent reads do not wait on each other: what a gateway replica reads to rebuild a session
(forge_stream.gateway.sessionreads). `Tail` reads what is appended to a topic from the moment it is made (the benchmarks
time records by it). Slices of history for replays are `forge_stream.kafka.history`'s.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from confluent_kafka import OFFSET_END, Consumer, KafkaException, TopicPartition

from forge_stream.events import DecodeError, decode, peek
from forge_stream.kafka.consumer import Event, event_of, low_high, offset_at_time
from forge_stream.kafka.partitioner import partition_for
from forge_stream.topics import Topic


class PartitionReader:
    """Reads of one partition at a time, outside any consumer group (nothing is committed), through a small pool
    of consumers so that concurrent reads do not wait on each other."""

    def __init__(self, bootstrap: str, timeout_s: float = 10.0, size: int = 4):
        self.bootstrap, self.timeout_s = bootstrap, timeout_s
        self._idle: queue.LifoQueue[Consumer] = queue.LifoQueue()
        self._slots = threading.Semaphore(size)
        self._partitions: dict[str, int] = {}

    @contextmanager
    def _consumer(self) -> Iterator[Consumer]:
        with self._slots:
            try:
                consumer = self._idle.get_nowait()
            except queue.Empty:
                # a fetch past the end waits at the broker up to fetch.wait.max.ms, and holds up the next request
                # on the connection (an offsets lookup): keep it short
                consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "forge-gateway-restore",
                                     "enable.auto.commit": False, "enable.partition.eof": False,
                                     "fetch.wait.max.ms": 5, "log_level": 0})
            try:
                yield consumer
            finally:
                self._idle.put(consumer)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def partitions(self, topic: Topic) -> int:
        if topic.name not in self._partitions:
            with self._consumer() as consumer:
                found = consumer.list_topics(topic.name, timeout=self.timeout_s).topics[topic.name]
                if found.error is not None or not found.partitions:
                    raise KafkaException(found.error)
                self._partitions[topic.name] = len(found.partitions)
        return self._partitions[topic.name]

    def partition_of(self, topic: Topic, key: str) -> int:
        """The partition every producer puts `key` in (murmur2, as Kafka's Java client:
        forge_stream.kafka.partitioner)."""
        return partition_for(key.encode(), self.partitions(topic))

    def high(self, topic: Topic, partition: int) -> int:
        with self._consumer() as consumer:
            return consumer.get_watermark_offsets(TopicPartition(topic.name, partition), timeout=self.timeout_s)[1]

    def offset_at(self, topic: Topic, partition: int, ms: int) -> int:
        """The first offset with a timestamp at or after `ms` (the end when there is none)."""
        with self._consumer() as consumer:
            return offset_at_time(consumer, topic.name, partition, ms, self.timeout_s)

    def read(self, topic: Topic, partition: int, start: int, end: int, key: str | None = None,
             session_id: str | None = None, skip: Container[int] = ()) -> list[tuple[int, int, str, dict]]:
        """(offset, timestamp ms, schema, record) of the records in [start, end) (only those keyed `key` and, when
        `session_id` is given, of that session, which are the only ones decoded: a record's session id is read from
        its leading fields first, when its bytes hold the id at all), but for the offsets in `skip`; undecodable
        records are skipped (the DLQ is the processors' business)."""
        out: list[tuple[int, int, str, dict]] = []
        if start >= end:
            return out
        wanted = key.encode() if key is not None else None
        needle = session_id.encode() if session_id is not None else b""
        with self._consumer() as consumer:
            try:
                for msg in records_between(consumer, topic.name, partition, start, end, self.timeout_s):
                    if wanted is not None and msg.key() != wanted or msg.offset() in skip:
                        continue
                    value = msg.value() or b""
                    try:
                        if session_id is not None and (needle not in value or  # not this session's: no peek
                                                       peek(value, ("session_id",))[1]["session_id"] != session_id):
                            continue
                        schema, record = decode(value)
                    except DecodeError:
                        continue
                    out.append((msg.offset(), msg.timestamp()[1], schema, record))
            finally:
                consumer.unassign()
        return out


def partition_records(consumer: Consumer, partitions: Iterable[tuple[str, int]], timeout_s: float,
                      bounds: Callable[[Consumer, str, int], tuple[int, int]] = low_high) -> Iterator:
    """The messages of every one of `partitions` ((topic, partition) pairs, in that order), each read with
    `consumer` from its low to its high watermark as `bounds` gives them when the read begins. Every partition's
    watermarks are taken before any is assigned: once one is, the consumer's fetch waits at the broker
    (fetch.wait.max.ms, 500 ms by default) and a watermark query after it on the connection queues behind it."""
    spans = [(topic, partition, *bounds(consumer, topic, partition)) for topic, partition in partitions]
    for topic, partition, low, high in spans:
        if low < high:
            yield from records_between(consumer, topic, partition, low, high, timeout_s)


def records_between(consumer: Consumer, topic: str, partition: int, start: int, end: int,
                    timeout_s: float) -> Iterator:
    """The messages at offsets [start, end) of one partition, read with `consumer` (assigned to it here)."""
    consumer.assign([TopicPartition(topic, partition, start)])
    offset = start
    while offset < end:
        msg = consumer.poll(timeout_s)
        if msg is None:
            raise TimeoutError(f"{topic}[{partition}] stopped at offset {offset} before {end}")
        if msg.error():
            continue
        offset = msg.offset() + 1
        if msg.offset() < end:
            yield msg


@dataclass(frozen=True)
class RawRecord:
    """A record as read, undecoded (the fields of a faust message the processors use)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def read_range(bootstrap: str, topic: str, partition: int, start: int, stop: int, timeout_s: float = 60.0
               ) -> list[RawRecord]:
    """The records of topic[partition] at offsets start <= offset < stop, in order, undecoded (offsets without a
    record, or deleted by retention, are simply not in the list)."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-read-range",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest", "log_level": 0})
    try:
        consumer.assign([TopicPartition(topic, partition, start)])
        records, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if consumer.position([TopicPartition(topic, partition)])[0].offset >= stop:
                    return records  # past the range without a record at its end
                continue
            if msg.error():
                continue
            if msg.offset() >= stop:
                return records
            records.append(RawRecord(topic, partition, msg.offset(), msg.key(), msg.value()))
            if msg.offset() == stop - 1:
                return records
        raise TimeoutError(f"reading {topic}[{partition}] offsets {start} to {stop - 1} took over {timeout_s} s")
    finally:
        consumer.close()


class Tail:
    """A topic's records appended after it was made (every partition from its end offset), decoded; undecodable
    records are passed over."""

    def __init__(self, bootstrap: str, topic: Topic):
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-tail",
                                   "enable.auto.commit": False, "log_level": 0})
        self._consumer.assign([TopicPartition(topic.name, p, OFFSET_END) for p in range(topic.partitions)])

    def poll(self, timeout: float) -> Event | None:
        msg = self._consumer.poll(timeout)
        if msg is None or msg.error():
            return None
        try:
            schema, record = decode(msg.value() or b"")
        except DecodeError:
            return None
        return event_of(msg, schema, record)

    def close(self) -> None:
        self._consumer.close()
