"""Group assembly: fold a rollout group's events into one JSON-ready state and decide when it is done.

A group is one task instance (its Task event gives G, seq and domain) and its G sessions. State per group:

    {"group_id", "partition", "task": Task | None, "first_ms", "last_ms",
     "sessions": {session_id: {"started_ms": int | None, "finished": SessionFinished | None}},
     "completions": {completion_id: Completion}, "spans": {span_id: ToolSpan},
     "rewards": {event_id: Reward}, "closed": False}

A session is *done* when its SessionFinished arrived, so did the `num_completions` completions it reports
(counted once per (request, choice_index): a call written twice is one completion) and the `num_tool_spans` ToolSpans
(distinct span ids), and either an outcome Reward arrived for it or its status is not ok (a failed rollout
needs no grade). The group is *complete* when its Task arrived and G sessions are done. Every event is stored
under its own identity, so a redelivered event changes nothing; of an inferred and an explicit span with the
same span id the explicit one is kept, whatever their order. Rewards published by the processors themselves
(source == settings.source) are not read back.

A session started with metadata {"purpose": "eval"} makes its group an evaluation group (`is_eval_start`): the
fold drops it without any output.

A group still open is *cut* (closed with what finished) when it goes idle, no event for `group_timeout_ms` after its
last one (`deadline_ms`, against wall time), or when it outgrows `group_max_completions` or `group_max_tokens`
(`over_size`). Its length in time is not bounded: a long session keeps its group open as long as its events come.

After the group's sample is emitted its state shrinks to a closed marker (`closed_marker`): later and
replayed events for it are ignored until the marker is forgotten (`forget_closed_ms` after closing).
"""

from __future__ import annotations

import math

from forge_stream.processors.rollouts import latest_completions
from forge_stream.processors.settings import ProcessorSettings

INPUT_SCHEMAS = ("Task", "SessionStarted", "SessionFinished", "Completion", "ToolSpan", "Reward")


class InvalidEvent(ValueError):
    """A decodable event that breaks a contract the processors rely on; it goes to the DLQ."""


def new_group(group_id: str, partition: int | None = None) -> dict:
    return {"group_id": group_id, "partition": partition, "task": None, "first_ms": None, "last_ms": None,
            "sessions": {}, "completions": {}, "spans": {}, "rewards": {}, "closed": False}


def validate(schema: str, record: dict) -> None:
    """Raise InvalidEvent when a record cannot be used (it is routed to the DLQ instead)."""
    if schema not in INPUT_SCHEMAS:
        raise InvalidEvent(f"the processors do not read {schema} events")
    if not record.get("group_id"):
        raise InvalidEvent(f"{schema} {record.get('event_id')} has no group_id")
    if not record["group_id"].isprintable():
        raise InvalidEvent(f"{schema} {record.get('event_id')}: group_id {record['group_id']!r} has a control "
                           f"character")
    if schema == "Task" and record["group_size"] < 1:
        raise InvalidEvent(f"Task {record['task_id']} has group_size {record['group_size']} (must be >= 1)")
    if schema == "Completion" and record["trainable"]:
        n, m = len(record["completion_token_ids"]), len(record["completion_logprobs"])
        if n != m:
            raise InvalidEvent(f"Completion {record['completion_id']}: {n} completion tokens but {m} logprobs")
    if schema == "Reward" and not math.isfinite(record["value"]):
        raise InvalidEvent(f"Reward {record['event_id']}: value {record['value']} is not a finite number")
    if schema == "Completion" and record["trainable"] and not all(map(math.isfinite, record["completion_logprobs"])):
        raise InvalidEvent(f"Completion {record['completion_id']}: a completion logprob is not finite")
    if schema == "Reward" and not record["metadata"].get("choice_index", "0").isdigit():
        raise InvalidEvent(f"Reward {record['event_id']}: metadata choice_index "
                           f"{record['metadata']['choice_index']!r} is not a choice index")


def is_eval_start(schema: str, record: dict) -> bool:
    """A SessionStarted of an evaluation session: its group is never trained on."""
    return schema == "SessionStarted" and record["metadata"].get("purpose") == "eval"


def apply(state: dict, schema: str, record: dict, settings: ProcessorSettings) -> dict:
    """Fold one validated event into an open group's state (in place; returns it)."""
    t = record["event_time"]
    state["first_ms"] = t if state["first_ms"] is None else min(state["first_ms"], t)
    state["last_ms"] = t if state["last_ms"] is None else max(state["last_ms"], t)
    if schema == "Task":
        state["task"] = record
    elif schema in ("SessionStarted", "SessionFinished"):
        session = _session(state, record["session_id"])
        if schema == "SessionStarted":  # a start written again (a retried open) does not shorten the session
            session["started_ms"] = t if session["started_ms"] is None else min(session["started_ms"], t)
        else:
            session["finished"] = record
    elif schema == "Completion":
        _session(state, record["session_id"])
        state["completions"][record["completion_id"]] = record
    elif schema == "ToolSpan":
        _session(state, record["session_id"])
        held = state["spans"].get(record["span_id"])
        if held is None or held["source"] != "explicit" or record["source"] == "explicit":
            state["spans"][record["span_id"]] = record
    elif schema == "Reward" and record["source"] != settings.source:
        if record.get("session_id"):
            _session(state, record["session_id"])
        state["rewards"][record["event_id"]] = record
    return state


def _session(state: dict, session_id: str) -> dict:
    return state["sessions"].setdefault(session_id, {"started_ms": None, "finished": None})


def outcome_rewards(state: dict) -> dict[str, list[dict]]:
    """Grader outcome rewards per session (several graders add up)."""
    out: dict[str, list[dict]] = {}
    for reward in state["rewards"].values():
        if reward["kind"] == "outcome" and reward.get("session_id"):
            out.setdefault(reward["session_id"], []).append(reward)
    return out


def done_sessions(state: dict) -> list[str]:
    """Sessions that finished, whose `num_completions` completions and `num_tool_spans` spans all arrived and
    that, if their status is ok, have an outcome reward (sorted ids). Topics are consumed in no particular order
    relative to each other, so a SessionFinished may be read before the session's last Completion or ToolSpan."""
    graded = outcome_rewards(state)
    spans: dict[str, int] = {}
    for span in state["spans"].values():
        spans[span["session_id"]] = spans.get(span["session_id"], 0) + 1
    return sorted(sid for sid, s in state["sessions"].items()
                  if s["finished"] is not None
                  and len(latest_completions(state, sid)) >= s["finished"]["num_completions"]
                  and spans.get(sid, 0) >= s["finished"]["num_tool_spans"]
                  and (sid in graded or s["finished"]["status"] != "ok"))


def is_complete(state: dict) -> bool:
    task = state["task"]
    return task is not None and len(done_sessions(state)) >= task["group_size"]


def deadline_ms(state: dict, settings: ProcessorSettings) -> int:
    """When a still-open group is cut for being idle: its last event's time plus the timeout (compared with wall
    time). Each event of the group moves it on."""
    return state["last_ms"] + settings.group_timeout_ms


def held_tokens(state: dict) -> int:
    """The token ids the group's completions hold: prompt ids as recorded (only the new ones of a prompt recorded by
    reference) plus completion ids."""
    return sum(len(c["prompt_token_ids"]) + len(c["completion_token_ids"]) for c in state["completions"].values())


def over_size(state: dict, settings: ProcessorSettings) -> str | None:
    """Why an open group has outgrown its size bound, in words (None while it has not)."""
    count = len(state["completions"])
    if count > settings.group_max_completions:
        return f"{count} completions, over the bound of {settings.group_max_completions}"
    tokens = held_tokens(state)
    if tokens > settings.group_max_tokens:
        return f"{tokens} token ids, over the bound of {settings.group_max_tokens}"
    return None


def due_ms(state: dict, settings: ProcessorSettings) -> int:
    """When `expire` will change the state: an open group's deadline, or when its closed marker is forgotten."""
    if state["closed"]:
        return state["closed_ms"] + settings.forget_closed_ms
    return deadline_ms(state, settings)


def due(state: dict, now_ms: int, settings: ProcessorSettings) -> bool:
    """Whether `expire` would change the state: an open group past its deadline, or a marker to forget."""
    return now_ms >= due_ms(state, settings)


def closed_marker(state: dict, closed_ms: int) -> dict:
    return {"group_id": state["group_id"], "partition": state["partition"], "closed": True, "closed_ms": closed_ms}
