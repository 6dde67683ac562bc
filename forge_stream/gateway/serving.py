"""The gateway's logic, without FastAPI: sessions (open, reward, tool spans, finish) on top of the completion
path (forge_stream.gateway.completing), which forwards calls to engines and records them.

- a session id is opened once: a SessionStarted already on Kafka for it (within `session_lookback_s`) answers 409,
  so a restarted gateway never starts an existing session over at turn 0;
- a finish waits for the session's calls in flight here, then counts what every worker recorded.

A session this process does not hold (opened by another replica, or before a restart) is rebuilt from its events
on Kafka before it is served (forge_stream.gateway.restore), and with `GatewaySettings.shared_sessions`
a held session is first brought up to date with what other replicas recorded for it.

A session's SessionFinished reports `num_tool_spans`, the distinct span ids of the ToolSpans recorded for it
(inferred and explicit; an explicit span replacing an inferred one keeps its span id), so the processors can
wait for them.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from forge_stream.events import deterministic_id, new_event_id, now_ms
from forge_stream.gateway.admission import Admission
from forge_stream.gateway.checks import check_id
from forge_stream.gateway.completing import CompletionPath, EventSink
from forge_stream.gateway.engines import EnginePool
from forge_stream.gateway.protocol import (
    FinishIn, GatewayError, RewardIn, SessionCreate, SessionCreated, SessionView, SpansIn,
)
from forge_stream.gateway.restore import SessionRestorer
from forge_stream.gateway.sessions import Session, SessionStore
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.gateway.spans import SessionKeys, explicit_span
from forge_stream.gateway.textspans import METADATA_KEY, load_rule
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


class GatewayService(CompletionPath):
    def __init__(self, settings: GatewaySettings, sink: EventSink, http: aiohttp.ClientSession):
        self.settings = settings
        self.sink = sink
        self.http = http
        self.sessions = SessionStore(settings.max_open_sessions, settings.finished_sessions_kept,
                                     settings.shed_retry_after_s, settings.admin_token or "")
        self.restorer = SessionRestorer(settings, self.sessions)
        self.pool = EnginePool(settings.engines, settings.max_queue)
        self.admission = Admission(settings.max_in_flight, settings.max_waiting, settings.max_wait_s,
                                   settings.shed_retry_after_s)

    async def open_session(self, request: SessionCreate, public_base: str) -> tuple[SessionCreated, bool]:
        """Open a session: (its answer, True) once it is recorded. A session id opened before (here, on another
        replica, or before a restart) is not opened again: the same group and task get the session as it stands
        ((its answer, False): a retried open whose first answer was lost goes on with its session), anything else
        409."""
        limit = self.settings.max_id_length
        check_id(request.group_id, "group_id", limit)
        check_id(request.task_id, "task_id", limit)
        for key in request.metadata:
            check_id(key, "metadata", limit)
        if request.session_id is not None:
            check_id(request.session_id, "session_id", limit, path_segment=True)
        session_id = request.session_id or new_event_id()
        if session_id in self.sessions or (request.session_id is not None
                                           and await self.restorer.started_elsewhere(session_id)):
            return self._reopened(await self.restorer.get(session_id), request, public_base), False
        self.sessions.check_room()
        rule = load_rule(request.metadata[METADATA_KEY]) if METADATA_KEY in request.metadata else None
        session = self.sessions.new(SessionKeys(session_id, request.group_id, request.task_id), request.metadata)
        session.span_rule = rule
        session.start_ms = now_ms()
        created = self._created(session, public_base)
        await self.publish([(TOPICS.sessions, request.group_id, {
            "event_id": new_event_id(), "event_time": now_ms(), "session_id": session_id,
            "group_id": request.group_id, "task_id": request.task_id, "base_url": created.base_url,
            "metadata": request.metadata}, "SessionStarted")])
        self.sessions.add(session)
        self.restorer.opened(session)
        return created, True

    def _created(self, session: Session, public_base: str) -> SessionCreated:
        path = f"/s/{session.id}/v1"
        return SessionCreated(session_id=session.id, base_url=(self.settings.public_url or public_base).rstrip("/")
                              + path, path=path, token=session.token, group_id=session.keys.group_id,
                              task_id=session.keys.task_id)

    def _reopened(self, session: Session, request: SessionCreate, public_base: str) -> SessionCreated:
        """The answer to opening `session` again: itself for the same group, task and metadata while it is open."""
        keys = session.keys
        same = (keys.group_id, keys.task_id, session.metadata) == (request.group_id, request.task_id, request.metadata)
        if not same or session.status != "open":
            why = "it is " + session.status if same else "with another group, task or metadata"
            raise GatewayError(409, f"Session {session.id} already exists, {why} (a session id is opened once; to go "
                                    f"on with it, call /s/{session.id}/v1/...).", "invalid_request_error",
                               "session_id")
        log.info("session %s: opened again by the same group and task: answered with the session (turn %d)",
                 session.id, session.turns)
        return self._created(session, public_base)

    def view(self, session: Session) -> SessionView:
        return SessionView(session_id=session.id, group_id=session.keys.group_id, task_id=session.keys.task_id,
                           status=session.status, turns=session.turns, completions=session.completions,
                           pending_tool_calls=sorted(session.pending))

    async def reward(self, session: Session, reward: RewardIn, idempotency_key: str | None = None) -> list[str]:
        """Record a reward. With an `Idempotency-Key`, its event id derives from the session and the key, so a
        retried post (its first answer lost) is the same event, which the processors count once."""
        session.require_open()
        keys = session.keys
        event_id = (deterministic_id("reward", keys.session_id, idempotency_key) if idempotency_key is not None
                    else new_event_id())
        record = {"event_id": event_id, "event_time": now_ms(), "group_id": keys.group_id,
                  "task_id": keys.task_id, "session_id": keys.session_id, **reward.model_dump()}
        await self.publish([(TOPICS.rewards, keys.group_id, record, None)])
        return [record["event_id"]]

    async def post_spans(self, session: Session, posted: SpansIn) -> list[str]:
        session.require_open()
        now = now_ms()
        records, replaced = [], []
        for span in posted.spans:
            call = session.pending.get(span.tool_call_id or "")
            records.append(explicit_span(session.keys, span.model_dump(), call, now))
            if call is not None:
                replaced.append(call)
        session.take_answered(replaced)
        try:
            offsets = await self.publish([(TOPICS.tool_spans, session.keys.group_id, r, None) for r in records])
        except GatewayError:
            session.restore(replaced)
            raise
        self.restorer.wrote(session, {TOPICS.tool_spans.name: offsets})
        session.explicit.update(s.tool_call_id for s in posted.spans if s.tool_call_id)
        session.span_ids.update(r["span_id"] for r in records)
        return [r["event_id"] for r in records]

    async def finish(self, session: Session, request: FinishIn) -> list[str]:
        """Record the session's SessionFinished: it takes no more calls, the calls in flight here end first, and
        it counts what every worker and replica recorded (spans posted elsewhere too)."""
        session.require_open()
        session.status = "finishing"
        keys = session.keys
        try:
            if session.active:
                log.info("session %s: finish waits for its %d calls in flight", session.id, session.active)
                try:
                    async with asyncio.timeout(self.settings.engine_timeout_s):
                        await session.idle.wait()
                except TimeoutError:
                    raise self.unavailable(f"Session {session.id} still has {session.active} calls in flight; "
                                           f"finish it again when they end.") from None
            async with session.recording, self.restorer.numbering(session, everyone=True):
                record = {"event_id": new_event_id(), "event_time": now_ms(), "session_id": keys.session_id,
                          "group_id": keys.group_id, "task_id": keys.task_id, "status": request.status,
                          "num_completions": session.completions, "reason": request.reason,
                          "num_tool_spans": len(session.span_ids)}
                await self.publish([(TOPICS.sessions, keys.group_id, record, "SessionFinished")])
                self.restorer.wrote(session)
        except BaseException:
            if session.status == "finishing":
                session.status = "open"
            raise
        self.sessions.finished(session)
        return [record["event_id"]]
