"""Session state kept in the gateway process: open/finished, turn counter, pending tool calls, agent token, and
the Responses API's stored responses, and the last chat completion of each (agent, choice) lane, which a later
prompt may be recorded by reference to.

It lives in memory: a restart loses the open sessions (their later calls get 404) and their pending tool calls
(those spans are not inferred), but never an event already acknowledged, since those are in Kafka.

Memory is bounded: at most `max_open` sessions are open (creating one more is refused with 429), and finished
sessions, stripped of their pending calls and stored responses, are kept only so that a late call gets 409; past
`finished_kept` of them the oldest is forgotten (a late call then gets 404).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from forge_stream.events.prompts import Lane
from forge_stream.gateway.protocol import GatewayError
from forge_stream.gateway.responses import StoredResponse
from forge_stream.gateway.spans import PendingCall, SessionKeys
from forge_stream.gateway.textspans import Rule, TextTurn


@dataclass
class Session:
    keys: SessionKeys
    token: str
    metadata: dict[str, str]
    status: str = "open"  # open, finishing, finished
    turns: int = 0  # requests recorded (a request with n choices is one turn)
    completions: int = 0  # Completion events recorded
    pending: dict[str, PendingCall] = field(default_factory=dict)
    explicit: set[str] = field(default_factory=set)  # call ids with a posted span: never inferred
    span_ids: set[str] = field(default_factory=set)  # distinct span ids of the ToolSpans recorded
    responses: dict[str, StoredResponse] = field(default_factory=dict)  # Responses API: previous_response_id
    lanes: dict[tuple[str, int], Lane] = field(default_factory=dict)  # (agent, choice) -> last chat completion
    recording: asyncio.Lock = field(default_factory=asyncio.Lock)  # held while a turn's events are written
    span_rule: Rule | None = None  # text-protocol tool spans (textspans), from the metadata's span_rule
    text_turns: dict[str, TextTurn] = field(default_factory=dict)  # agent -> its last completion, under a rule

    @property
    def id(self) -> str:
        return self.keys.session_id

    def require_open(self) -> None:
        if self.status != "open":
            raise GatewayError(409, f"Session {self.id} is {self.status}; it takes no more calls.",
                               "invalid_request_error", "session_id")

    def take_answered(self, calls: list[PendingCall]) -> None:
        for call in calls:
            self.pending.pop(call.tool_call_id, None)

    def restore(self, calls: list[PendingCall]) -> None:
        for call in calls:
            self.pending.setdefault(call.tool_call_id, call)

    def add_pending(self, calls: list[PendingCall]) -> None:
        for call in calls:
            if call.tool_call_id not in self.explicit:
                self.pending[call.tool_call_id] = call


class SessionStore:
    def __init__(self, max_open: int = 100_000, finished_kept: int = 10_000, retry_after_s: float = 1.0):
        self._sessions: dict[str, Session] = {}
        self._by_token: dict[str, str] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # oldest first
        self.max_open, self.finished_kept, self.retry_after_s = max_open, finished_kept, retry_after_s

    @property
    def open(self) -> int:
        return len(self._sessions) - len(self._finished)

    def check_room(self) -> None:
        """429 when `max_open` sessions are open already (checked before a new one is recorded)."""
        if self.open >= self.max_open:
            raise GatewayError(429, f"{self.open} sessions are open, the gateway's limit; finish some first.",
                               "rate_limit_error", retry_after=self.retry_after_s)

    def finished(self, session: Session) -> None:
        """Note that `session` finished; forget the oldest finished sessions past `finished_kept`."""
        self._finished[session.id] = None
        while len(self._finished) > self.finished_kept:
            old, _ = self._finished.popitem(last=False)
            self._by_token.pop(self._sessions.pop(old).token, None)

    def new(self, keys: SessionKeys, metadata: dict[str, str]) -> Session:
        return Session(keys, "fs-" + secrets.token_urlsafe(24), metadata)

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session
        self._by_token[session.token] = session.id

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"Session {session_id!r} does not exist (create it with POST /v1/sessions).",
                               "not_found_error", "session_id")
        return session

    def by_token(self, token: str) -> Session | None:
        session_id = self._by_token.get(token)
        return self._sessions.get(session_id) if session_id else None

    def __len__(self) -> int:
        return len(self._sessions)
