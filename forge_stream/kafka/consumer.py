"""The package's group consumers, and the one path by which any of them commits offsets.

`DecodingConsumer` decodes catalog events and routes what it cannot decode to `forge.dlq`, then goes on.

Errors are data: a record with a bad frame, an unknown schema id, a corrupt body or a schema the topic does not
carry becomes a DeadLetter (original bytes, topic, partition, offset, error, who rejected it). The dead letter is
acknowledged by Kafka before the consumer moves past it, so nothing is lost. While Kafka is away, polls come back
empty and commits are retried until they go through: a consumer waits an outage out rather than crash.

Commits. Every consumer that commits (the windowed FIFO, the Parquet and TensorBoard sinks, a new run's start)
keeps its positions in `Watermarks` and commits through `commit_patiently`: per partition, up to the first
record it still holds (read, not yet settled), never backwards, and only what moved since the last commit.
`AssignedConsumer` reads every partition of some topics from a group's committed offsets without joining the
group (no rebalancing: the TensorBoard sink); `commit_end_offsets` and `has_committed_offsets` start a group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, TopicPartition

from forge_stream.events import DecodeError, decode, deterministic_id, now_ms
from forge_stream.kafka.clientlog import CLIENT_LOG
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS, Topic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Event:
    topic: str
    partition: int
    offset: int
    key: str | None
    schema: str
    record: dict
    timestamp_ms: int


def event_of(msg, schema: str, record: dict) -> Event:
    """The Event of a polled Kafka message and its decoded record."""
    key = msg.key().decode(errors="replace") if msg.key() is not None else None
    return Event(msg.topic(), msg.partition(), msg.offset(), key, schema, record, msg.timestamp()[1])


def dead_letter(topic: str, partition: int, offset: int, key: bytes | None, value: bytes | None,
                error: str, rejected_by: str) -> dict:
    """A DeadLetter record; its id is derived from where the bad record sits, so re-rejecting it is idempotent."""
    return {
        "event_id": deterministic_id("dlq", topic, partition, offset, rejected_by),
        "event_time": now_ms(), "topic": topic, "partition": partition, "offset": offset,
        "key": key, "value": value, "error": error, "rejected_by": rejected_by,
    }


def consumer_config(bootstrap: str, group_id: str, **overrides) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        # isolation.level stays read_uncommitted (the default): no producer of forge-stream uses transactions, so
        # every record is committed once acknowledged and read_committed would only add the wait for the last
        # stable offset
        "session.timeout.ms": 10000,
        **overrides,
    }


# errors that mean "Kafka is away or moving": wait them out rather than crash
WAIT_ERRORS = {KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
               KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR, KafkaError._WAIT_COORD,
               KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.REQUEST_TIMED_OUT}


# the group moved on without this member (its coordinator failed over, or it was too slow): it rejoins on its next
# poll, and this commit's offsets go with the next one
REJOIN_ERRORS = {KafkaError.UNKNOWN_MEMBER_ID, KafkaError.ILLEGAL_GENERATION, KafkaError.REBALANCE_IN_PROGRESS}


def commit_patiently(consumer: Consumer, offsets: list[TopicPartition], name: str) -> bool:
    """A synchronous commit that, while Kafka is away, retries every second until it goes through. False when the
    group refused it because this member must rejoin: nothing is lost, since offsets only move forward and the
    next commit carries these; what was read past the last commit is read again after the rejoin (consumers here
    skip what they already handled: the windowed consumer's retired groups, the Parquet sink's file names)."""
    told = False
    while True:
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
            return True
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() in REJOIN_ERRORS:
                log.warning("consumer %s: commit refused (%s): the group is rebalancing; it goes with the next "
                            "commit", name, error)
                return False
            if not (error.retriable() or error.code() in WAIT_ERRORS):
                raise
            if not told:
                log.warning("consumer %s: commit failed (%s); retrying until Kafka answers", name, error)
                told = True
            time.sleep(1.0)


class Watermarks:
    """Per partition, how far a consumer may commit: past every record it read, up to (not including) the first
    record it still holds (read, not yet settled: a group not trained yet, a row not written yet). A commit sends
    only the partitions whose mark moved, and a refused one (the member must rejoin) goes with the next."""

    def __init__(self):
        self.read: dict[tuple[str, int], int] = {}  # per partition: the next offset to read
        self._held: dict[tuple[str, int], set[int]] = {}
        self._committed: dict[tuple[str, int], int] = {}

    def moved_to(self, topic: str, partition: int, position: int) -> None:
        """The consumer's position on the partition is `position` (it only moves forward)."""
        tp = (topic, partition)
        self.read[tp] = max(self.read.get(tp, 0), position)

    def passed(self, topic: str, partition: int, offset: int) -> None:
        """The consumer read past this record."""
        self.moved_to(topic, partition, offset + 1)

    def hold(self, topic: str, partition: int, offset: int) -> None:
        """No commit on the partition may pass this record until it is released."""
        self._held.setdefault((topic, partition), set()).add(offset)

    def release(self, topic: str, partition: int, offset: int) -> None:
        self._held[(topic, partition)].discard(offset)

    def due(self) -> dict[tuple[str, int], int]:
        """The offsets to commit now: per partition, its first held record (or its position), if it moved."""
        due = {}
        for tp, end in self.read.items():
            held = self._held.get(tp)
            mark = min(min(held), end) if held else end
            if mark > self._committed.get(tp, 0):
                due[tp] = mark
        return due

    def commit(self, consumer: Consumer, name: str) -> None:
        """Commit what is due through `commit_patiently`."""
        due = self.due()
        if due and commit_patiently(consumer, [TopicPartition(t, p, o) for (t, p), o in due.items()], name):
            self._committed.update(due)


class DecodingConsumer:
    """Poll decoded events from catalog topics (subscribed, in a consumer group). Every record polled, event or
    dead letter, moves `marks`; commits are explicit (`commit()`: what `marks` allows). `caught_up` says whether
    it has read every partition it was assigned up to the end (its high watermark) since the assignment."""

    def __init__(self, bootstrap: str, group_id: str, topics: list[Topic], *, name: str,
                 producer: EventProducer | None = None, **config):
        self.name = name
        self.marks = Watermarks()
        self._topics = {t.name: t for t in topics}
        self._consumer = Consumer(consumer_config(bootstrap, group_id, **{
            "enable.partition.eof": True, "logger": CLIENT_LOG, **config}))  # its log: served by `poll`
        self._assigned: set[tuple[str, int]] = set()
        self._at_end: set[tuple[str, int]] = set()
        self._consumer.subscribe(list(self._topics), on_assign=self._on_assign, on_revoke=self._on_revoke)
        self._owns_producer = producer is None
        self._producer = producer or EventProducer(bootstrap)
        self.dead_letters = 0

    def poll(self, timeout: float = 1.0) -> Event | None:
        """The next decodable event, or None when none arrived within `timeout` (dead letters are passed over)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self._consumer.poll(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    self._at_end.add((msg.topic(), msg.partition()))
                    continue
                if msg.error().retriable() or msg.error().code() in WAIT_ERRORS:
                    log.warning("consumer %s: %s; waiting for Kafka", self.name, msg.error())
                    return None
                raise RuntimeError(f"consumer {self.name}: {msg.error()}")
            try:
                schema, record = decode(msg.value() or b"")
                allowed = self._topics[msg.topic()].value_schemas
                if schema not in allowed:
                    raise DecodeError(f"{msg.topic()} carries {', '.join(allowed)}, not {schema}")
            except DecodeError as exc:
                self._reject(msg, str(exc))
                continue
            self.marks.passed(msg.topic(), msg.partition(), msg.offset())
            return event_of(msg, schema, record)

    @property
    def assigned(self) -> bool:
        """Whether the group gave this consumer any partition yet."""
        return bool(self._assigned)

    @property
    def caught_up(self) -> bool:
        """Whether it reached the end of every partition it holds since they were assigned (what a record of one
        partition says about order can only be trusted once the others have been read up to now as well)."""
        return bool(self._assigned) and self._assigned <= self._at_end

    def _on_assign(self, consumer, partitions) -> None:
        self._assigned = {(tp.topic, tp.partition) for tp in partitions}
        self._at_end.clear()

    def _on_revoke(self, consumer, partitions) -> None:
        self._assigned.clear()
        self._at_end.clear()

    def _reject(self, msg, error: str) -> None:
        record = dead_letter(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), error, self.name)
        self._producer.send_sync(TOPICS.dlq, msg.topic(), record)
        self.marks.passed(msg.topic(), msg.partition(), msg.offset())  # settled: acknowledged on forge.dlq
        self.dead_letters += 1

    def commit(self) -> None:
        """Commit what `marks` allows (waiting while Kafka is away)."""
        self.marks.commit(self._consumer, self.name)

    def close(self) -> None:
        self._consumer.close()
        if self._owns_producer:
            self._producer.close()


RETRIABLE = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TRANSPORT,
             KafkaError._ALL_BROKERS_DOWN}  # a broker restarting (the supervisor restarts the embedded one)
COORDINATOR_STARTING = {KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
                        KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TRANSPORT}


def _retrying(call, codes: set, attempts: int = 50):
    """`call()`, retried every 0.2 s while it fails with one of `codes` (a fresh broker or partition settling)."""
    for attempt in range(attempts):
        try:
            return call()
        except KafkaException as exc:
            if exc.args[0].code() not in codes or attempt == attempts - 1:
                raise
            time.sleep(0.2)
    raise AssertionError("unreachable")


def low_high(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
    """Low and high offsets, retrying while a freshly created partition has no leader yet."""
    return _retrying(lambda: consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10),
                     RETRIABLE)


def offset_at_time(consumer: Consumer, topic: str, partition: int, ms: int, timeout: float = 10.0) -> int:
    """The first offset with a timestamp at or after `ms` (the partition's end when there is none)."""
    found = consumer.offsets_for_times([TopicPartition(topic, partition, max(ms, 0))], timeout=timeout)[0]
    if found.offset in (-1, OFFSET_END):
        return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)[1]
    return found.offset


def _committed(consumer: Consumer, partitions: list[TopicPartition]) -> dict[tuple[str, int], int]:
    """The group's committed offsets (-1 where none), retrying while a fresh broker elects the coordinator."""
    found = _retrying(lambda: consumer.committed(partitions, timeout=10), COORDINATOR_STARTING)
    return {(tp.topic, tp.partition): tp.offset for tp in found}


def _partitions(topics: list[Topic]) -> list[TopicPartition]:
    return [TopicPartition(t.name, p) for t in topics for p in range(t.partitions)]


def has_committed_offsets(bootstrap: str, group_id: str, topics: list[Topic]) -> bool:
    """Whether the group committed an offset on any partition of `topics`."""
    consumer = Consumer(consumer_config(bootstrap, group_id))
    try:
        return any(offset >= 0 for offset in _committed(consumer, _partitions(topics)).values())
    finally:
        consumer.close()


def commit_end_offsets(bootstrap: str, group_id: str, topics: list[Topic]) -> None:
    """Start the group at the current end of `topics`: what came before is not its to read."""
    consumer = Consumer(consumer_config(bootstrap, group_id))
    try:
        offsets = [TopicPartition(tp.topic, tp.partition, low_high(consumer, tp.topic, tp.partition)[1])
                   for tp in _partitions(topics)]
        commit_patiently(consumer, offsets, group_id)
    finally:
        consumer.close()


class Position(NamedTuple):
    """Where a consumer group stands on one partition."""

    committed: int | None  # the group's committed offset (the next to read); None without one
    end: int  # the partition's end (high watermark)
    low: int  # its first offset still kept (low watermark)


def partition_positions(bootstrap: str, group_id: str, partitions: list[tuple[str, int]]
                        ) -> dict[tuple[str, int], Position]:
    """Per partition: the consumer group's committed offset, and the partition's end and low watermark."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id, "enable.auto.commit": False,
                         "log_level": 0})
    try:
        tps = consumer.committed([TopicPartition(t, p) for t, p in partitions], timeout=10)
        positions = {}
        for tp in tps:
            low, end = consumer.get_watermark_offsets(tp, timeout=10)
            positions[(tp.topic, tp.partition)] = Position(tp.offset if tp.offset >= 0 else None, end, low)
        return positions
    finally:
        consumer.close()


class AssignedConsumer:
    """Every partition of `topics`, assigned (no group membership, so no rebalancing), from the group's committed
    offsets (or from each partition's beginning); polls decoded events. `ends` are the partitions' ends when it
    started; `marks.read` its positions; `commit()` commits them. A record it cannot decode goes to
    `on_undecodable(topic, partition, offset, error)` and is passed over."""

    def __init__(self, bootstrap: str, group_id: str, topics: list[Topic], *, name: str,
                 from_beginning: bool = False,
                 on_undecodable: Callable[[str, int, int, str], None] | None = None):
        self.name = name
        self.marks = Watermarks()
        self.ends: dict[tuple[str, int], int] = {}
        self._topics = {t.name: t for t in topics}
        self._on_undecodable = on_undecodable
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group_id,
                                   "enable.auto.commit": False, "log_level": 0})
        partitions = _partitions(topics)
        committed = {} if from_beginning else _committed(self._consumer, partitions)
        for tp in partitions:
            low, high = low_high(self._consumer, tp.topic, tp.partition)
            start = committed.get((tp.topic, tp.partition), -1)
            self.marks.moved_to(tp.topic, tp.partition, start if start >= low else low)
            self.ends[(tp.topic, tp.partition)] = high
        self._consumer.assign([TopicPartition(t, p, offset) for (t, p), offset in self.marks.read.items()])

    def at_end(self) -> bool:
        """Whether it read up to the ends the partitions had when it started."""
        return all(self.marks.read[tp] >= end for tp, end in self.ends.items())

    def poll(self, timeout: float) -> Event | None:
        """The next decodable event, or None."""
        msg = self._consumer.poll(timeout)
        if msg is None:
            self._catch_up()
            return None
        if msg.error():
            return None
        self.marks.passed(msg.topic(), msg.partition(), msg.offset())
        try:
            schema, record = decode(msg.value() or b"")
            if schema not in self._topics[msg.topic()].value_schemas:
                raise DecodeError(f"{msg.topic()} does not carry {schema}")
        except DecodeError as exc:
            if self._on_undecodable is not None:
                self._on_undecodable(msg.topic(), msg.partition(), msg.offset(), str(exc))
            return None
        return event_of(msg, schema, record)

    def _catch_up(self) -> None:
        """Move past what no message stands for (transaction markers), as the consumer's own position says."""
        for tp in self._consumer.position([TopicPartition(t, p) for t, p in self.marks.read]):
            if tp.offset >= 0:
                self.marks.moved_to(tp.topic, tp.partition, tp.offset)

    def commit(self) -> None:
        self.marks.commit(self._consumer, self.name)

    def close(self) -> None:
        self._consumer.close()
