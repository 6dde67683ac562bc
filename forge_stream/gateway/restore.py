"""Sessions rebuilt from their events on Kafka, so that a restarted gateway, or any of several replicas, serves a
session it does not hold in memory.

On a call for a session this process does not hold, the gateway looks its SessionStarted (and SessionFinished)
up in `SessionDirectory`, an index of forge.sessions read lazily (from `session_lookback_s` ago at the first miss,
then only what was appended since), reads the session's Completions and ToolSpans from the one partition of each
topic its group id is keyed to, from its start (by timestamp, less `clock_skew_ms`), and folds them (`fold`) into
its state: turn counter, completion count, the last completion of each (agent, choice) lane that later prompts are
recorded by reference to, pending tool calls, and the spans recorded. A finished session comes back finished.

Shared sessions (`GatewaySettings.shared_sessions`): when replicas serve one session's calls alternately, the one
holding it may be behind. Before each call of a held session it reads the session's Completions partition past
what it has seen (`changed`); a completion it did not record makes it rebuild the session first, and a
SessionFinished recorded elsewhere closes it. There is no lock across replicas: two replicas serving one session
at the same time can both record turn k. The next check finds it: it is logged as a turn collision, counted in
/health, and the session rebuilt (turn numbers go on past both).

The reads are blocking (confluent-kafka); the service runs them in threads.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import orjson
from confluent_kafka import OFFSET_END, Consumer, KafkaException, TopicPartition

from forge_stream.events import DecodeError, decode, now_ms
from forge_stream.events.prompts import Lane, MissingReference, message_digest, whole_completions
from forge_stream.gateway.sessions import Session
from forge_stream.gateway.spans import pending_calls
from forge_stream.topics import TOPICS, Topic

log = logging.getLogger(__name__)


class KafkaReader:
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
                consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "forge-gateway-restore",
                                     "enable.auto.commit": False, "enable.partition.eof": False, "log_level": 0})
            try:
                yield consumer
            finally:
                self._idle.put(consumer)

    def partitions(self, topic: Topic) -> int:
        if topic.name not in self._partitions:
            with self._consumer() as consumer:
                found = consumer.list_topics(topic.name, timeout=self.timeout_s).topics[topic.name]
                if found.error is not None or not found.partitions:
                    raise KafkaException(found.error)
                self._partitions[topic.name] = len(found.partitions)
        return self._partitions[topic.name]

    def partition_of(self, topic: Topic, key: str) -> int:
        """The partition the producers' partitioner (librdkafka's default, consistent_random: CRC32 of the key)
        puts `key` in."""
        return zlib.crc32(key.encode()) % self.partitions(topic)

    def high(self, topic: Topic, partition: int) -> int:
        with self._consumer() as consumer:
            return consumer.get_watermark_offsets(TopicPartition(topic.name, partition), timeout=self.timeout_s)[1]

    def offset_at(self, topic: Topic, partition: int, ms: int) -> int:
        """The first offset with a timestamp at or after `ms` (the end when there is none)."""
        with self._consumer() as consumer:
            found = consumer.offsets_for_times([TopicPartition(topic.name, partition, max(ms, 0))],
                                               timeout=self.timeout_s)[0]
            if found.offset in (-1, OFFSET_END):
                return consumer.get_watermark_offsets(TopicPartition(topic.name, partition),
                                                      timeout=self.timeout_s)[1]
            return found.offset

    def read(self, topic: Topic, partition: int, start: int, end: int,
             key: str | None = None) -> list[tuple[int, int, str, dict]]:
        """(offset, timestamp ms, schema, record) of the records in [start, end) (only those keyed `key`, which
        are the only ones decoded); undecodable records are skipped (the DLQ is the processors' business)."""
        out: list[tuple[int, int, str, dict]] = []
        if start >= end:
            return out
        wanted = key.encode() if key is not None else None
        with self._consumer() as consumer:
            consumer.assign([TopicPartition(topic.name, partition, start)])
            try:
                offset = start
                while offset < end:
                    msg = consumer.poll(self.timeout_s)
                    if msg is None:
                        raise TimeoutError(f"{topic.name}[{partition}] stopped at offset {offset} before {end}")
                    if msg.error():
                        continue
                    offset = msg.offset() + 1
                    if msg.offset() >= end or (wanted is not None and msg.key() != wanted):
                        continue
                    try:
                        schema, record = decode(msg.value() or b"")
                    except DecodeError:
                        continue
                    out.append((msg.offset(), msg.timestamp()[1], schema, record))
            finally:
                consumer.unassign()
        return out


@dataclass
class Entry:
    """What forge.sessions says of one session."""

    started: dict
    start_ms: int
    finished: dict | None = None


class SessionDirectory:
    """forge.sessions, read lazily into a map of session id to its SessionStarted and SessionFinished. The first
    lookup reads from `lookback_s` ago; later ones only what was appended since (of the partitions asked for).
    Finished sessions are kept up to `finished_kept`, the oldest forgotten first."""

    def __init__(self, reader: KafkaReader, lookback_s: float, finished_kept: int):
        self.reader, self.lookback_s, self.finished_kept = reader, lookback_s, finished_kept
        self._entries: dict[str, Entry] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._positions: dict[int, int] = {}
        self._lock = threading.Lock()

    def find(self, session_id: str, partitions: Iterable[int] | None = None) -> Entry | None:
        with self._lock:
            topic = TOPICS.sessions
            for p in range(self.reader.partitions(topic)) if partitions is None else partitions:
                high = self.reader.high(topic, p)
                start = self._positions.get(p)
                if start is None:
                    start = self.reader.offset_at(topic, p, now_ms() - int(self.lookback_s * 1000))
                for _, timestamp, schema, record in self.reader.read(topic, p, start, high):
                    self._note(schema, record, timestamp)
                self._positions[p] = max(start, high)
            return self._entries.get(session_id)

    def _note(self, schema: str, record: dict, timestamp: int) -> None:
        sid = record["session_id"]
        if schema == "SessionStarted":
            self._entries.setdefault(sid, Entry(record, timestamp))
        elif sid in self._entries and self._entries[sid].finished is None:
            self._entries[sid].finished = record
            self._finished[sid] = None
            while len(self._finished) > self.finished_kept:
                self._entries.pop(self._finished.popitem(last=False)[0], None)


def _is_chat(record: dict) -> bool:
    """Whether a recorded Completion answered a chat request (its messages_json a list of message objects)."""
    if record["prompt_ref"] is not None:
        return True
    messages = orjson.loads(record["messages_json"])
    return isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)


def fold(session: Session, completions: list[dict], spans: list[dict], prompt_refs: bool) -> list[int]:
    """Set `session`'s counters, lanes, pending tool calls and span ids from its recorded Completions and ToolSpans
    (each in the order recorded); returns the turn numbers that more than one request recorded (collisions)."""
    requests: dict[int, set[str]] = defaultdict(set)
    for record in completions:
        requests[record["turn"]].add(record["request_id"])
    session.turns = max(requests) + 1 if requests else 0
    session.completions = len(completions)
    session.requests = {r["request_id"] for r in completions}
    session.span_ids = {s["span_id"] for s in spans}
    session.explicit = {s["tool_call_id"] for s in spans if s["source"] == "explicit" and s["tool_call_id"]}
    answered = {s["tool_call_id"] for s in spans if s["tool_call_id"]}
    session.pending = {}
    for record in completions:
        calls = orjson.loads(record["tool_calls_json"]) if record["tool_calls_json"] else None
        for call in pending_calls(calls, issued_ms=record["done_ms"], completion_id=record["completion_id"],
                                  agent=record["agent"]):
            if call.tool_call_id not in answered:
                session.add_pending([call])
    session.lanes = {}
    if prompt_refs:
        chat = [r for r in completions if _is_chat(r)]
        try:
            rebuilt = whole_completions(chat)
        except MissingReference as exc:  # its start is before what was read: later prompts are recorded whole
            log.warning("session %s: lanes not rebuilt (%s)", session.id, exc)
            rebuilt = []
        for record in rebuilt:
            if record["prompt_token_ids"]:
                digests = tuple(message_digest(orjson.dumps(m)) for m in orjson.loads(record["messages_json"]))
                session.lanes[(record["agent"], record["choice_index"])] = Lane(
                    record["completion_id"], record["prompt_token_ids"], record["completion_token_ids"], digests)
    return sorted(turn for turn, ids in requests.items() if len(ids) > 1)


class SessionRestorer:
    """Blocking reads of a session's events, and its state rebuilt from them."""

    def __init__(self, bootstrap: str, lookback_s: float, clock_skew_ms: int, finished_kept: int,
                 timeout_s: float = 10.0):
        self.reader = KafkaReader(bootstrap, timeout_s)
        self.directory = SessionDirectory(self.reader, lookback_s, finished_kept)
        self.clock_skew_ms = clock_skew_ms

    def _from(self, topic: Topic, partition: int, session: Session) -> int:
        return self.reader.offset_at(topic, partition, session.start_ms - self.clock_skew_ms)

    def _session_records(self, topic: Topic, session: Session, start: int | None) -> tuple[list[dict], int]:
        """The session's records on `topic` from `start` (None: from its start time), and the end read to."""
        group = session.keys.group_id
        p = self.reader.partition_of(topic, group)
        end = self.reader.high(topic, p)
        begin = self._from(topic, p, session) if start is None else start
        records = [r for _, _, _, r in self.reader.read(topic, p, begin, end, key=group)
                   if r["session_id"] == session.id]
        return records, end

    def load(self, session: Session, prompt_refs: bool) -> list[int]:
        """Rebuild `session` (keys and start time set) from its events; returns the collided turn numbers."""
        spans, _ = self._session_records(TOPICS.tool_spans, session, None)
        completions, session.seen = self._session_records(TOPICS.completions, session, None)
        return fold(session, completions, spans, prompt_refs)

    def changed(self, session: Session) -> tuple[bool, dict | None]:
        """(whether a completion this process did not record was added to the session since it last looked, its
        SessionFinished when it was finished elsewhere)."""
        completions, end = self._session_records(TOPICS.completions, session, session.seen)
        foreign = any(r["request_id"] not in session.requests for r in completions)
        if not foreign:
            session.seen = end
        entry = self.directory.find(session.id, [self.reader.partition_of(TOPICS.sessions, session.keys.group_id)])
        return foreign, entry.finished if entry is not None else None
