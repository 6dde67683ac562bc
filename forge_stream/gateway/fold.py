"""The fold: a session's state from its recorded events, pure (no Kafka, no I/O).

`fold` sets a `Session`'s turn counter, completion count, requests, pending tool calls, span ids and lanes (the last
completion of each (agent, choice) that later prompts are recorded by reference to) from its Completions and
ToolSpans, in the order recorded, and names the turns two requests recorded (collisions). `fold_more` adds what was
recorded since the session was last built, or raises `NotFoldable` when that cannot be added (rebuild it whole).
Reading the records is forge_stream.gateway.sessionreads; when to fold is forge_stream.gateway.restore.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import orjson

from forge_stream.events.prompts import Lane, message_digest
from forge_stream.gateway.sessions import Session
from forge_stream.gateway.spans import pending_calls

log = logging.getLogger(__name__)


def is_chat(record: dict) -> bool:
    """Whether a recorded Completion answered a chat request (its messages_json a list of message objects)."""
    if record["prompt_ref"] is not None:
        return True
    messages = orjson.loads(record["messages_json"])
    return isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)


def _digests(messages_json: str) -> tuple[bytes, ...]:
    """The message_digest of each message of a recorded JSON list, as the gateway took them of the request's."""
    return tuple(message_digest(orjson.dumps(m)) for m in orjson.loads(messages_json))


def fold(session: Session, completions: list[dict], spans: list[dict], prompt_refs: bool) -> list[int]:
    """Set `session`'s counters, lanes, pending tool calls and span ids from its recorded Completions and ToolSpans
    (each in the order recorded); returns the turn numbers that more than one request recorded (collisions)."""
    requests: dict[int, set[str]] = defaultdict(set)
    for record in completions:
        requests[record["turn"]].add(record["request_id"])
    session.turns = max(requests) + 1 if requests else 0
    # one per (request, choice), as the processors count them (a call written twice is one completion)
    session.completions = len({(r["request_id"], r["choice_index"]) for r in completions})
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
    if prompt_refs:  # each lane built from the one it extends: no prompt is rebuilt whole
        known: dict[str, Lane] = {}
        request = None
        for record in completions:
            if not is_chat(record):
                continue
            if record["request_id"] != request:  # what a request can extend: the lanes held when it was served
                request, known = record["request_id"], {lane.completion_id: lane for lane in session.lanes.values()}
            key = (record["agent"], record["choice_index"])
            try:
                lane = known[record["completion_id"]] = _lane(record, known)
            except NotFoldable as exc:  # it extends what was not read: the lane's next prompt is recorded whole
                log.warning("session %s: lane %s not rebuilt (%s)", session.id, key, exc)
                session.lanes.pop(key, None)
                continue
            if lane.prompt_len:
                session.lanes[key] = lane
    return sorted(turn for turn, ids in requests.items() if len(ids) > 1)


class NotFoldable(Exception):
    """What was recorded since a session was last built cannot be added to it: rebuild it from its start."""


def fold_more(session: Session, completions: list[dict], spans: list[dict], prompt_refs: bool) -> None:
    """Add to `session` its Completions and ToolSpans recorded since it was last built (each list in the order
    recorded, read from where its last build or catch-up ended; those this process recorded, folded already, are
    among them: known by request id and span id). The result is `fold` of all its records, as long as the others'
    records come after this process's own in each turn's order; NotFoldable (the session is then left half
    updated: rebuild it) when they do not: another replica recorded a turn this process also took (a collision),
    or extended a completion this process no longer holds as a lane."""
    for span in spans:
        if span["span_id"] in session.span_ids:
            continue
        session.span_ids.add(span["span_id"])
        if span["source"] == "explicit" and span["tool_call_id"]:
            session.explicit.add(span["tool_call_id"])
    answered = {s["tool_call_id"] for s in spans if s["tool_call_id"]}
    known = {lane.completion_id: lane for lane in session.lanes.values()} if prompt_refs else {}
    new_requests: set[str] = set()
    for record in completions:
        request = record["request_id"]
        if request in session.requests:
            continue
        if request not in new_requests:
            if record["turn"] < session.turns:
                raise NotFoldable(f"turn {record['turn']} was recorded by two requests")
            new_requests.add(request)
        session.turns = max(session.turns, record["turn"] + 1)
        session.completions += 1
        calls = orjson.loads(record["tool_calls_json"]) if record["tool_calls_json"] else None
        session.add_pending([call for call in pending_calls(calls, issued_ms=record["done_ms"],
                                                            completion_id=record["completion_id"],
                                                            agent=record["agent"])
                             if call.tool_call_id not in answered])
        if prompt_refs and is_chat(record):
            lane = _lane(record, known)
            known[lane.completion_id] = lane
            if lane.prompt_len:
                session.lanes[(record["agent"], record["choice_index"])] = lane
    session.requests |= new_requests
    for call_id in answered:
        session.pending.pop(call_id, None)


def _lane(record: dict, known: dict[str, Lane]) -> Lane:
    """A chat Completion as a lane: its whole prompt ids and message digests, its reference looked up in `known`."""
    added = _digests(record["messages_json"])
    if record["prompt_ref"] is None:
        return Lane(record["completion_id"], record["prompt_token_ids"], record["completion_token_ids"], added)
    ref = known.get(record["prompt_ref"])
    if ref is None:
        raise NotFoldable(f"completion {record['completion_id']} extends {record['prompt_ref']}, not held here")
    try:
        return ref.extended(record["completion_id"], record["prompt_ref_tokens"], record["prompt_token_ids"],
                            record["completion_token_ids"], ref.messages[:record["prompt_ref_messages"]] + added)
    except ValueError as exc:  # the reference takes more (or fewer) ids than the lane it names has
        raise NotFoldable(f"completion {record['completion_id']}: {exc}") from exc
