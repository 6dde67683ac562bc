"""Session state kept in the gateway process: open/finished, turn counter, pending tool calls, agent token, and
the Responses API's stored responses, and the last chat completion of each (agent, choice) lane, which a later
prompt may be recorded by reference to.

It lives in memory, as a cache of the session's events on Kafka: a session this process does not hold (opened by
another replica, or before a restart) is rebuilt from those events (forge_stream.gateway.restore).

Memory is bounded: at most `max_open` sessions are open (creating one more is refused with 429), and finished
sessions, stripped of their pending calls and stored responses, are kept only so that a late call gets 409; past
`finished_kept` of them the oldest is forgotten (a late call then gets 404).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
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
    requests: set[str] = field(default_factory=set)  # request ids of the turns this process knows were recorded
    start_ms: int = 0  # when it started (its SessionStarted's timestamp): where its events begin on Kafka
    seen: int | None = None  # its Completions partition is known up to this offset (None: from start_ms)
    spans_seen: int | None = None  # and its ToolSpans partition up to this one
    # offsets of the records this process wrote past those (topic name -> offsets), folded already: a catch-up
    # skips them undecoded (kept only where sessions are shared: SessionRestorer.wrote)
    own_offsets: dict[str, set[int]] = field(default_factory=dict)
    opened_here: bool = False  # opened by this process, which holds all it recorded: caught up from its start
    ledger_seen: tuple[int, ...] | None = None  # --workers: the other workers' ledger counters it is up to date with
    unsure: bool = False  # a write was not acknowledged and may have landed: read the log before the next turn
    calls: dict[str, asyncio.Event] = field(default_factory=dict)  # request id -> set when that call here ends
    active: int = 0  # calls of it in flight in this process (a finish waits for them)
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while none is

    def __post_init__(self):
        self.idle.set()

    def enter(self, request_id: str) -> None:
        """A call of the session (`request_id`) is in flight here."""
        self.active += 1
        self.idle.clear()
        self.calls[request_id] = asyncio.Event()

    def leave(self, request_id: str) -> None:
        """The call `request_id` ended (recorded or not)."""
        self.calls.pop(request_id).set()
        self.active -= 1
        if not self.active:
            self.idle.set()

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


def unknown(session_id: str) -> GatewayError:
    return GatewayError(404, f"Session {session_id!r} does not exist (create it with POST /v1/sessions).",
                        "not_found_error", "session_id")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def session_token(secret: str, session_id: str) -> str:
    """A session's agent token: its id and a MAC of it under `secret` (the admin token), so that every replica
    knows which session a token reaches without having seen it issued.

    >>> token = session_token("s3cret", "abc")
    >>> token_session("s3cret", token), token_session("other", token), token_session("s3cret", token + "x")
    ('abc', None, None)
    """
    mac = hmac.new(secret.encode(), session_id.encode(), "sha256").digest()[:18]
    return f"fs-{_b64(session_id.encode())}.{_b64(mac)}"


def token_session(secret: str, token: str) -> str | None:
    """The session id `token` was issued for, or None when it is not a valid session token."""
    if not token.startswith("fs-") or "." not in token:
        return None
    try:
        encoded = token[3:token.rindex(".")]
        session_id = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return session_id if hmac.compare_digest(session_token(secret, session_id), token) else None


class SessionStore:
    def __init__(self, max_open: int = 100_000, finished_kept: int = 10_000, retry_after_s: float = 1.0,
                 secret: str = ""):
        self._sessions: dict[str, Session] = {}
        self.secret = secret  # the MAC key of session tokens
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
        """Mark `session` finished, keeping only what a late call's 409 needs; forget the oldest finished sessions
        past `finished_kept`."""
        session.status = "finished"
        for kept in (session.pending, session.responses, session.explicit, session.span_ids, session.lanes,
                     session.requests, session.text_turns):
            kept.clear()
        self._finished[session.id] = None
        while len(self._finished) > self.finished_kept:
            old, _ = self._finished.popitem(last=False)
            self._sessions.pop(old)

    def new(self, keys: SessionKeys, metadata: dict[str, str]) -> Session:
        return Session(keys, session_token(self.secret, keys.session_id), metadata)

    def add(self, session: Session) -> None:
        self._sessions[session.id] = session

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def held(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def owner(self, token: str) -> str | None:
        """The id of the session `token` belongs to (held here or not), or None."""
        return token_session(self.secret, token)

    def __len__(self) -> int:
        return len(self._sessions)
