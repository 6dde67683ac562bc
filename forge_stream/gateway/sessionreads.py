"""The gateway's Kafka reads of sessions, blocking (`forge_stream.kafka.reader.PartitionReader`).

`SessionDirectory` is forge.sessions read lazily into a map of session id to its SessionStarted and SessionFinished;
`SessionEvents` reads one session's Completions and ToolSpans from the one partition of each topic its group id is
keyed to, from its start (by timestamp, less the clock skew) or from where it last read, and folds them into the
session (forge_stream.gateway.fold). forge_stream.gateway.restore runs these reads in threads.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from forge_stream.events import now_ms
from forge_stream.events.prompts import MissingReference, whole_completions
from forge_stream.gateway.fold import NotFoldable, fold, fold_more, is_chat
from forge_stream.gateway.sessions import Session
from forge_stream.kafka.reader import PartitionReader
from forge_stream.topics import TOPICS, Topic

log = logging.getLogger(__name__)


@dataclass
class Entry:
    """What forge.sessions says of one session."""

    started: dict
    start_ms: int
    finished: dict | None = None


class SessionDirectory:
    """forge.sessions, read lazily into a map of session id to its SessionStarted and SessionFinished. The first
    lookup reads from `lookback_s` ago; later ones only what was appended since (of the partitions asked for).
    Finished sessions are kept up to `finished_kept`, and sessions started more than `lookback_s` ago not at all,
    the oldest forgotten first."""

    def __init__(self, reader: PartitionReader, lookback_s: float, finished_kept: int):
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
            cutoff = now_ms() - int(self.lookback_s * 1000)
            while self._entries:  # sessions left open past the lookback (abandoned) are forgotten, oldest first
                oldest = next(iter(self._entries))
                if self._entries[oldest].start_ms >= cutoff:
                    break
                del self._entries[oldest]
                self._finished.pop(oldest, None)
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


class SessionEvents:
    """Blocking reads of one session's events, and its state rebuilt from them."""

    def __init__(self, reader: PartitionReader, clock_skew_ms: int):
        self.reader, self.clock_skew_ms = reader, clock_skew_ms
        self.records_read = 0  # the sessions' records decoded, by rebuilds and catch-ups
        self.records_scanned = 0  # and the records they went through (their partitions' offsets) to find those

    def _records(self, topic: Topic, session: Session, start: int | None,
                 own: bool = True) -> tuple[list[dict], int]:
        """The session's records on `topic` from offset `start` (None: from its start time), and the end read to;
        without those this process wrote since it last read them (`Session.own_offsets`) unless `own`."""
        group = session.keys.group_id
        p = self.reader.partition_of(topic, group)
        end = self.reader.high(topic, p)
        if start is None:
            start = self.reader.offset_at(topic, p, session.start_ms - self.clock_skew_ms)
        skip = () if own else session.own_offsets.get(topic.name, ())
        records = [r for _, _, _, r in self.reader.read(topic, p, start, end, key=group, session_id=session.id,
                                                         skip=skip)]
        self.records_read += len(records)
        self.records_scanned += max(end - start, 0)
        return records, end

    @staticmethod
    def _read_to(session: Session, topic: Topic, end: int) -> None:
        """`session`'s records on `topic` before `end` are folded: forget the offsets of its own ones there."""
        own = session.own_offsets.get(topic.name)
        if own:
            own.difference_update([offset for offset in own if offset < end])

    def load(self, session: Session, prompt_refs: bool) -> list[int]:
        """Rebuild `session` (keys and start time set) from its events; returns the collided turn numbers."""
        spans, session.spans_seen = self._records(TOPICS.tool_spans, session, None)
        completions, session.seen = self._records(TOPICS.completions, session, None)
        self._read_to(session, TOPICS.tool_spans, session.spans_seen)
        self._read_to(session, TOPICS.completions, session.seen)
        return fold(session, completions, spans, prompt_refs)

    def catch_up(self, session: Session, prompt_refs: bool) -> list[int]:
        """Bring a held `session` up to date: fold in what was recorded since it was last built or caught up (read
        from there, not from its start), or rebuild it when that cannot be folded in (`fold_more`) or it was never
        built here; returns the collided turn numbers."""
        if (session.seen is None or session.spans_seen is None) and not session.opened_here:
            return self.load(session, prompt_refs)  # (opened here, it holds what it recorded: read from its start)
        spans, spans_end = self._records(TOPICS.tool_spans, session, session.spans_seen, own=False)
        completions, end = self._records(TOPICS.completions, session, session.seen, own=False)
        try:
            fold_more(session, completions, spans, prompt_refs)
        except NotFoldable as exc:
            log.info("session %s: rebuilt from its start (%s)", session.id, exc)
            return self.load(session, prompt_refs)
        session.seen, session.spans_seen = end, spans_end
        self._read_to(session, TOPICS.tool_spans, spans_end)
        self._read_to(session, TOPICS.completions, end)
        return []

    def answered(self, session: Session, request_id: str) -> list[dict]:
        """The session's Completions recorded for `request_id` (one per choice, in choice order; the last write of
        each)."""
        completions, _ = self._records(TOPICS.completions, session, None)
        choices = {r["choice_index"]: r for r in completions if r["request_id"] == request_id}
        return [choices[c] for c in sorted(choices)]

    def chat_completion(self, session: Session, request_id: str) -> dict | None:
        """The session's chat completion (choice 0) recorded for `request_id`, its prompt rebuilt whole."""
        completions, _ = self._records(TOPICS.completions, session, None)
        try:
            rebuilt = whole_completions([r for r in completions if is_chat(r)])
        except MissingReference:
            return None
        return next((r for r in rebuilt if r["request_id"] == request_id and r["choice_index"] == 0), None)
