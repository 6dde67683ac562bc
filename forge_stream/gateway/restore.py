"""The restorer (`SessionRestorer`): a gateway process's sessions, those it holds and those rebuilt from their events
on Kafka, so that a restarted gateway, or any of several replicas, serves a session it does not hold in memory. It
decides when to read and fold; the reads are forge_stream.gateway.sessionreads', the fold forge_stream.gateway.fold's.

On a call for a session this process does not hold, the gateway looks its SessionStarted (and SessionFinished)
up in `SessionDirectory`, an index of forge.sessions read lazily (from `session_lookback_s` ago at the first miss,
then only what was appended since), reads the session's Completions and ToolSpans from the one partition of each
topic its group id is keyed to, from its start (by timestamp, less `clock_skew_ms`), and folds them (`fold`) into
its state: turn counter, completion count, the last completion of each (agent, choice) lane that later prompts are
recorded by reference to, pending tool calls, and the spans recorded. A finished session comes back finished. A
Responses API `previous_response_id` it does not hold is rebuilt from the Completion that answered it (`response`).

Shared sessions (`GatewaySettings.shared_sessions`): when replicas serve one session's calls alternately, the one
holding it may be behind. Each replica follows what the others record (forge_stream.kafka.sessionlog): before a
call of a held session it waits until that tail has read everything acknowledged before the call (one end-offsets
lookup, shared by the calls that arrived meanwhile); a Completion another replica recorded past what this one read
of the session makes it catch the session up first, and a SessionFinished recorded elsewhere closes it. So a replica
that keeps serving its sessions reads no session's events per call; a session that moves between replicas costs one
catch-up per move: the records since the replica last read the session, folded into what it holds (`fold_more`),
not the session read again from its start (a turn collision, or a reference to a completion no longer held as a
lane, rebuilds it from its start instead). A finish catches the session up first, so that its SessionFinished
counts the completions and spans every replica recorded (a span may have been posted to another). There is no lock
across replicas on several hosts: two replicas serving one session at the same time can both record turn k. The next
call finds it: it is logged as a turn collision, counted in /health, and the session rebuilt (turn numbers go on past
both); the processors number such turns from the log too (forge_stream.processors.rollouts: two requests at one
turn number are two turns), so the session completes and both calls are trained. A load balancer that routes by the session's path (`/s/{session_id}/...`) never sends
one session to two replicas at once.

Workers of one host (`gateway serve --workers N`, `GatewaySettings.worker_ledger`) learn the same from a ledger in
shared memory instead (forge_stream.gateway.ledger): a held session whose bucket another worker wrote to since it was
last brought up to date is caught up (or closed, if finished there); otherwise a call asks nothing of Kafka. Workers
number a session's turns under the session's lock in that ledger (`SessionRestorer.numbering`), so they never
collide, and run a call sent with an Idempotency-Key one worker at a time (`SessionRestorer.claim`), so it runs once.

The reads are blocking (`forge_stream.kafka.reader.PartitionReader`); `SessionRestorer` runs them in threads and
answers 503 when Kafka does not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from confluent_kafka import KafkaException

from forge_stream.gateway.ledger import LockBusy, WorkerLedger
from forge_stream.gateway.protocol import GatewayError
from forge_stream.gateway.responses import StoredResponse, assistant_message, recorded_request
from forge_stream.gateway.sessionreads import Entry, SessionDirectory, SessionEvents
from forge_stream.gateway.sessions import Session, SessionStore, unknown
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.gateway.spans import SessionKeys
from forge_stream.gateway.textspans import METADATA_KEY, load_rule
from forge_stream.kafka.reader import PartitionReader
from forge_stream.kafka.sessionlog import SessionLog
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


MAX_OWN_OFFSETS = 512  # per session and topic (about 30 KB): what a catch-up skips undecoded


class SessionRestorer:
    """A gateway process's sessions: those `store` holds, else rebuilt from Kafka; with shared sessions, held ones
    brought up to date first. Counts the sessions rebuilt and the turn collisions found."""

    def __init__(self, settings: GatewaySettings, store: SessionStore):
        self.settings, self.store = settings, store
        reader = PartitionReader(settings.bootstrap, settings.ack_timeout_ms / 1000)
        self.directory = SessionDirectory(reader, settings.session_lookback_s, settings.finished_sessions_kept)
        self.events = SessionEvents(reader, settings.clock_skew_ms)
        self.log = (SessionLog(settings.bootstrap, settings.ack_timeout_ms / 1000,
                               settings.max_open_sessions + settings.finished_sessions_kept)
                    if settings.shared_sessions else None)
        # workers of one `serve --workers N` on this host, without replicas elsewhere: they tell each other what
        # they recorded through the ledger (forge_stream.gateway.ledger) instead of following Kafka
        self.ledger = (WorkerLedger(settings.worker_ledger, settings.workers)
                       if settings.worker_ledger is not None and self.log is None else None)
        self._loading: dict[str, asyncio.Future] = {}
        self._claimed: set[str] = set()  # request ids of the calls this process claimed from the other workers
        self.restored = 0
        self.refreshed = 0  # held sessions caught up because another replica recorded for them
        self.collisions: set[tuple[str, int]] = set()  # (session id, turn) recorded by two requests

    async def _kafka(self, read, *args):
        """A blocking read of Kafka, in a thread; 503 when Kafka does not answer."""
        try:
            return await asyncio.to_thread(read, *args)
        except (KafkaException, TimeoutError) as exc:
            log.warning("a session's events could not be read from Kafka: %s", exc)
            raise GatewayError(503, "The session's events could not be read from Kafka; retry shortly.",
                               "service_unavailable", retry_after=self.settings.retry_after_s) from exc

    async def start(self) -> None:
        """With shared sessions: start following what other replicas record."""
        if self.log is not None:
            for topic in (TOPICS.completions, TOPICS.sessions):
                await self._kafka(self.directory.reader.partitions, topic)
            try:
                await self.log.start()
            except (KafkaException, TimeoutError) as exc:
                raise RuntimeError(f"the gateway cannot follow forge.completions and forge.sessions: {exc}") from exc

    async def close(self) -> None:
        if self.log is not None:
            await asyncio.to_thread(self.log.close)
        if self.ledger is not None:
            self.ledger.close()
        await asyncio.to_thread(self.directory.reader.close)

    async def started_elsewhere(self, session_id: str) -> bool:
        return await self._kafka(self.directory.find, session_id) is not None

    async def get(self, session_id: str) -> Session:
        """The session `session_id`: held here, or rebuilt from its events on Kafka (404 when it has none)."""
        session = self.store.held(session_id)
        if session is None:
            loading = self._loading.get(session_id)
            if loading is None:  # one rebuild per session, however many calls wait for it
                loading = self._loading[session_id] = asyncio.ensure_future(self._restore(session_id))
                loading.add_done_callback(lambda _: self._loading.pop(session_id, None))
            return await asyncio.shield(loading)
        if session.status == "open":
            if self.log is not None:
                await self._refresh(session)
            elif self.ledger is not None and self.ledger.others(session.id) != session.ledger_seen:
                await self._catch_up(session)
        return session

    def opened(self, session: Session) -> None:
        """`session` was opened here: up to date with the other workers."""
        if self.ledger is not None:
            session.ledger_seen = self.ledger.others(session.id)
        session.opened_here = True

    def wrote(self, session: Session, offsets: dict[str, list[int]] | None = None) -> None:
        """Kafka acknowledged events of `session` recorded here (at `offsets`: topic name -> offsets, in the
        session's partitions of forge.completions and forge.tool_spans): the other workers learn it from the ledger,
        and this process's next catch-up of the session passes over those records (`Session.own_offsets`)."""
        if self.ledger is not None:
            self.ledger.wrote(session.id)
        if offsets and (self.ledger is not None or self.log is not None):
            for topic, written in offsets.items():
                own = session.own_offsets.setdefault(topic, set())
                if len(own) + len(written) > MAX_OWN_OFFSETS:  # served here alone for long: the next catch-up
                    own.clear()  # decodes the older ones and tells them by request and span id instead
                own.update(written)

    async def _catch_up(self, session: Session) -> None:
        """Another worker of this host recorded for a held session (or one sharing its ledger bucket): catch it up
        on its events, closing it if it was finished there."""
        async with session.recording:
            seen = self.ledger.others(session.id)  # read before the events: a later write shows at the next call
            if seen == session.ledger_seen or session.status != "open":
                return
            partition = self.directory.reader.partition_of(TOPICS.sessions, session.keys.group_id)
            entry = await self._kafka(self.directory.find, session.id, [partition])
            if entry is not None and entry.finished is not None:
                self.store.finished(session)
            else:
                self._note(session, await self._kafka(self.events.catch_up, session, self.settings.prompt_refs))
                self.refreshed += 1
            session.ledger_seen = seen

    @asynccontextmanager
    async def numbering(self, session: Session, everyone: bool = False) -> AsyncIterator[None]:
        """Held (inside `session.recording`) while this process numbers and records a turn of `session`, or counts
        its turns for its SessionFinished (`everyone`: with shared sessions, what other replicas recorded too). First
        brings the session up to date where it may be behind: another worker of this host recorded for it (the
        ledger; the block then holds the session's lock against the other workers, so no two number a turn at once),
        another replica did (`everyone`), or a write of this process was not acknowledged and may have landed
        (`Session.unsure`). A session finished elsewhere meanwhile is closed here (409). A worker that holds the
        session's lock past `turn_lock_wait_s` (hung) is given up on: 503 with Retry-After."""
        if self.ledger is None:
            if session.unsure or (everyone and self.log is not None):
                await self._bring_up(session, finished_check=False)
            yield
            return
        byte = self.ledger.session_byte(session.id)
        wait = self.settings.turn_lock_wait_s
        await self._take(byte, wait, f"Another worker of this gateway has held the lock of session {session.id}'s "
                                     f"turns for over {wait:g} s (it may be stuck); nothing was recorded: retry soon.")
        try:
            seen = self.ledger.others(session.id)  # read before the events: a later write shows at the next call
            if session.unsure or seen != session.ledger_seen:
                await self._bring_up(session, finished_check=seen != session.ledger_seen)
                session.ledger_seen = seen
            yield
        finally:
            self.ledger.drop(byte)

    async def _take(self, byte: int, wait_s: float, busy: str) -> None:
        """Take the ledger's lock of `byte`; 503 saying `busy` when another worker still holds it after `wait_s`."""
        try:
            await self.ledger.take(byte, wait_s)
        except LockBusy as exc:
            log.warning("%s", exc)
            raise GatewayError(503, busy, "service_unavailable", retry_after=self.settings.retry_after_s) from exc

    async def claim(self, request_id: str) -> None:
        """Workers of one host: wait until no other worker runs the call `request_id` (an Idempotency-Key's), and
        keep the others from running it until `release` (after it was recorded or failed). 503 after waiting
        `engine_timeout_s` and `turn_lock_wait_s`, the longest a try of it takes."""
        if self.ledger is None:
            return
        wait = self.settings.engine_timeout_s + self.settings.turn_lock_wait_s
        await self._take(self.ledger.call_byte(request_id), wait,
                         f"Another worker of this gateway has been serving the call with this Idempotency-Key for "
                         f"over {wait:g} s; retry it shortly (once that try ends it is answered as recorded).")
        self._claimed.add(request_id)

    def release(self, request_id: str) -> None:
        """The call `request_id` this process `claim`ed ended: other workers may serve it (as recorded, if it was)."""
        if request_id in self._claimed:
            self._claimed.discard(request_id)
            self.ledger.drop(self.ledger.call_byte(request_id))

    async def _bring_up(self, session: Session, finished_check: bool) -> None:
        if finished_check:
            partition = self.directory.reader.partition_of(TOPICS.sessions, session.keys.group_id)
            entry = await self._kafka(self.directory.find, session.id, [partition])
            if entry is not None and entry.finished is not None:
                self.store.finished(session)
                session.require_open()
        self._note(session, await self._kafka(self.events.catch_up, session, self.settings.prompt_refs))
        session.unsure = False
        self.refreshed += 1

    async def answered(self, session: Session, request_id: str) -> list[dict]:
        """The Completions recorded for the call `request_id` of `session` (none: it was not recorded)."""
        return await self._kafka(self.events.answered, session, request_id)

    async def _refresh(self, session: Session) -> None:
        """Bring a held session up to date with what other replicas recorded for it."""
        reader, group = self.directory.reader, session.keys.group_id
        try:
            await self.log.caught_up({t.name: reader.partition_of(t, group) for t in (TOPICS.completions,
                                                                                   TOPICS.sessions)})
        except (KafkaException, TimeoutError) as exc:
            log.warning("what other replicas recorded could not be read from Kafka: %s", exc)
            raise GatewayError(503, "What other replicas recorded could not be read from Kafka; retry shortly.",
                               "service_unavailable", retry_after=self.settings.retry_after_s) from exc
        if session.id in self.log.finished:
            if session.status == "open":
                self.store.finished(session)
            return
        if self.log.foreign.get(session.id, -1) >= (session.seen or 0):
            async with session.recording:
                if self.log.foreign.get(session.id, -1) >= (session.seen or 0):
                    self._note(session, await self._kafka(self.events.catch_up, session, self.settings.prompt_refs))
                    self.refreshed += 1

    async def response(self, session: Session, response_id: str) -> None:
        """Put the stored response `response_id` (served by another replica, or before a restart) into `session`'s
        chain, rebuilt from the Completion that answered it; nothing when there is none."""
        recorded = recorded_request(response_id)
        if recorded is None:
            return
        record = await self._kafka(self.events.chat_completion, session, recorded[0])
        if record is None:
            return
        messages = orjson.loads(record["messages_json"])[1 if recorded[1] else 0:]
        calls = orjson.loads(record["tool_calls_json"]) if record["tool_calls_json"] else None
        session.responses[response_id] = StoredResponse(None, messages + [assistant_message(record["output_text"],
                                                                                           calls)])

    async def _restore(self, session_id: str) -> Session:
        entry: Entry | None = await self._kafka(self.directory.find, session_id)
        if entry is None:
            raise unknown(session_id)
        started = entry.started
        seen = self.ledger.others(session_id) if self.ledger is not None else None
        session = self.store.new(SessionKeys(session_id, started["group_id"], started["task_id"]),
                                 dict(started["metadata"]))
        session.start_ms = entry.start_ms
        session.ledger_seen = seen
        if METADATA_KEY in started["metadata"]:  # its text-protocol span rule, as when it was opened
            try:
                session.span_rule = load_rule(started["metadata"][METADATA_KEY])
            except GatewayError as exc:
                log.warning("session %s: its span rule cannot be loaded here (%s); no text spans", session_id, exc)
        if entry.finished is None:
            self._note(session, await self._kafka(self.events.load, session, self.settings.prompt_refs))
        held = self.store.held(session_id)
        if held is not None:  # opened here while it was read
            return held
        self.store.add(session)
        self.restored += 1
        if entry.finished is not None:
            self.store.finished(session)
        return session

    def _note(self, session: Session, collided: list[int]) -> None:
        for turn in collided:
            if (session.id, turn) not in self.collisions:
                self.collisions.add((session.id, turn))
                log.error("session %s: turn %d was recorded by two requests (two gateway replicas served it at "
                          "once); its next turn is %d", session.id, turn, session.turns)
