"""The fault suite's checks after the run: drain topics without a consumer group, inject poison, and
recompute a group's rewards from the source topics in one batch.

`drain` reads a topic from its first to its last offset (the high watermark when it is called, so everything
acknowledged before is below it), without a consumer group (no producer uses transactions, so every record there
is committed). `recompute`
folds a group's source events (forge.tasks, sessions, completions, tool_spans and the graders' rewards) through
the processors' pure fold in one pass, the way a batch job over the topics would, and returns what the live
processors should have published for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer

from forge_stream.events import DecodeError, decode, encode, new_event_id, now_ms
from forge_stream.kafka.consumer import low_high
from forge_stream.kafka.producer import producer_config
from forge_stream.kafka.reader import partition_records
from forge_stream.processors import InvalidEvent, ProcessorSettings, fold
from forge_stream.topics import TOPICS, Topic

SOURCES = (TOPICS.tasks, TOPICS.sessions, TOPICS.completions, TOPICS.tool_spans, TOPICS.rewards)


@dataclass(frozen=True)
class Record:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    schema: str | None  # None: undecodable
    event: dict | None


def bounds(consumer: Consumer, topic: str, partition: int, attempts: int = 6) -> tuple[int, int]:
    """A partition's low and high watermarks, asked again when a busy broker lets the request time out."""
    for attempt in range(attempts):
        try:
            return low_high(consumer, topic, partition)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError._TIMED_OUT or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def drain(bootstrap: str, topic: Topic) -> list[Record]:
    """Every record of `topic`, partition by partition in offset order."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "fault-suite-drain", "enable.auto.commit": False,
                         "log_level": 0})
    out = []
    try:
        for msg in partition_records(consumer, [(topic.name, p) for p in range(topic.partitions)], 30, bounds):
            try:
                schema, event = decode(msg.value() or b"")
            except DecodeError:
                schema, event = None, None
            out.append(Record(topic.name, msg.partition(), msg.offset(), msg.key(), msg.value() or b"", schema, event))
    finally:
        consumer.close()
    return out


def events(records: list[Record]) -> list[dict]:
    return [r.event for r in records if r.event is not None]


def inject_poison(bootstrap: str, live_session: dict, run: str) -> tuple[list[tuple[str, int, int]], list[str]]:
    """Poison on every input topic of the processors and the trainer: undecodable bytes (under a poison group's key)
    on each, a Task with group_size 0, and a NaN outcome reward for `live_session` (a SessionStarted record) of a
    group being rolled out. Returns where each poison record landed (topic, partition, offset) and the poison
    group ids."""
    producer = Producer(producer_config(bootstrap))
    landed: list[tuple[str, int, int]] = []

    def delivered(err, msg):
        assert err is None, err
        landed.append((msg.topic(), msg.partition(), msg.offset()))

    poison_groups = []
    for topic in (*SOURCES, TOPICS.samples):
        group = f"{run}-poison-{topic.name.split('.')[-1]}"
        poison_groups.append(group)
        producer.produce(topic.name, key=group.encode(), value=b"\x00\x00\x00\x00\x07not an event",
                         on_delivery=delivered)
    group = f"{run}-poison-task"
    poison_groups.append(group)
    producer.produce(TOPICS.tasks.name, key=group.encode(), on_delivery=delivered, value=encode("Task", {
        "event_id": new_event_id(), "event_time": now_ms(), "task_id": group, "group_id": group, "seq": 10**6,
        "domain": "qa", "grader": "exact", "group_size": 0, "prompt_json": "{}", "metadata": {}}))
    producer.produce(TOPICS.rewards.name, key=live_session["group_id"].encode(), on_delivery=delivered,
                     value=encode("Reward", {
                         "event_id": new_event_id(), "event_time": now_ms(), "group_id": live_session["group_id"],
                         "task_id": live_session["task_id"], "session_id": live_session["session_id"],
                         "kind": "outcome", "name": "poison", "value": math.nan, "turn": None, "source": "grader",
                         "metadata": {}}))
    assert producer.flush(60) == 0
    return landed, poison_groups


def recompute(group_id: str, sources: dict[str, list[Record]], settings: ProcessorSettings) -> list[dict]:
    """What the processors publish for `group_id`, folded in one pass over its source events in event-time order
    (ties in topic and offset order); invalid events are skipped, as the live fold dead-letters them."""
    mine = [(r.event["event_time"], i, r) for i, r in enumerate(r for topic in SOURCES for r in sources[topic.name]
                                                               if r.event is not None
                                                               and r.event.get("group_id") == group_id)]
    state, out = None, []
    for _, _, r in sorted(mine, key=lambda x: (x[0], x[1])):
        try:
            state, emits = fold(state, r.schema, r.event, settings)
        except InvalidEvent:
            continue
        out += [e.record for e in emits]
    return out
