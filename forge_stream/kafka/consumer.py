"""A consumer that decodes catalog events and routes what it cannot decode to `forge.dlq`, then goes on.

Errors are data: a record with a bad frame, an unknown schema id, a corrupt body or a schema the topic does not
carry becomes a DeadLetter (original bytes, topic, partition, offset, error, who rejected it). The dead letter is
acknowledged by Kafka before the consumer moves past it, so nothing is lost. While Kafka is away, polls come back
empty and commits are retried until they go through: a consumer waits an outage out rather than crash.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from forge_stream.events import DecodeError, decode, deterministic_id, now_ms
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
        "isolation.level": "read_committed",
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


class DecodingConsumer:
    """Poll decoded events from catalog topics; commits are explicit (`commit(event)`)."""

    def __init__(self, bootstrap: str, group_id: str, topics: list[Topic], *, name: str,
                 producer: EventProducer | None = None,
                 on_dead_letter: Callable[[str, int, int], None] | None = None, **config):
        self.name = name
        self._on_dead_letter = on_dead_letter
        self._topics = {t.name: t for t in topics}
        self._consumer = Consumer(consumer_config(bootstrap, group_id, **config))
        self._consumer.subscribe(list(self._topics))
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
                    return None
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
            key = msg.key().decode(errors="replace") if msg.key() is not None else None
            return Event(msg.topic(), msg.partition(), msg.offset(), key, schema, record, msg.timestamp()[1])

    @property
    def assigned(self) -> bool:
        """Whether the group gave this consumer any partition yet."""
        return bool(self._consumer.assignment())

    def _reject(self, msg, error: str) -> None:
        record = dead_letter(msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value(), error, self.name)
        self._producer.send_sync(TOPICS.dlq, msg.topic(), record)
        self.dead_letters += 1
        if self._on_dead_letter is not None:
            self._on_dead_letter(msg.topic(), msg.partition(), msg.offset())

    def commit(self, positions: dict[tuple[str, int], int]) -> None:
        """Commit each (topic, partition) up to, not including, its offset: the next record to read there (waiting
        while Kafka is away)."""
        commit_patiently(self._consumer, [TopicPartition(t, p, o) for (t, p), o in positions.items()], self.name)

    def close(self) -> None:
        self._consumer.close()
        if self._owns_producer:
            self._producer.close()
