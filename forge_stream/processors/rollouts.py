"""Which completions of a session form one rollout (one trajectory of the group, one sample of the advantage).

A session's completions are indexed by (choice_index, turn); a request with n choices records n completions at
the same turn. Definitions, in the order they apply:

1. Retries. A turn retried after a failed write reuses its turn number (same session, choice and turn): the
   completion with the later (event_time, completion_id) supersedes the other, which is neither trained nor
   scored. `latest_completions` keeps one completion per (choice_index, turn).
2. Lane 0, the session's main line: its choice-0 completions in turn order. An agent continues its conversation
   from the choice it picks by sending a new request, whose single choice is again choice 0.
3. Lane c > 0, a sibling rollout: lane 0's turns *before* the first turn at which choice c appears (the prefix
   the n choices share), then the session's choice-c completions in turn order. With one n > 1 request (best-of-n
   at some turn, the usual case) lane c is exactly "the shared history plus that choice". With several n > 1
   requests in one session, lane c collects choice c of each of them: a bookkeeping line for rewards, not a
   conversation (each completion is still trained with the exact prompt it was given).

A rollout's id is the session id for lane 0 and `<session_id>:<c>` for lane c. Lane 0 always exists, even
without completions (a session that failed before its first call still has a trajectory); lane c exists when
choice c does. A turn of lane 0 that lies in a sibling's prefix belongs to both rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSpec:
    rollout_id: str
    session_id: str
    choice_index: int
    completions: tuple[dict, ...]  # in turn order; for c > 0 the borrowed lane-0 prefix comes first


def rollout_id(session_id: str, choice_index: int) -> str:
    """The rollout of lane `choice_index` of a session.

    >>> rollout_id("s1", 0), rollout_id("s1", 2)
    ('s1', 's1:2')
    """
    return session_id if choice_index == 0 else f"{session_id}:{choice_index}"


def latest_completions(state: dict, session_id: str) -> dict[tuple[int, int], dict]:
    """(choice_index, turn) -> the session's completion for it, a retried turn's later write winning."""
    out: dict[tuple[int, int], dict] = {}
    for comp in state["completions"].values():
        if comp["session_id"] != session_id:
            continue
        key = (comp["choice_index"], comp["turn"])
        held = out.get(key)
        if held is None or (comp["event_time"], comp["completion_id"]) > (held["event_time"], held["completion_id"]):
            out[key] = comp
    return out


def session_rollouts(state: dict, session_id: str) -> list[RolloutSpec]:
    """The session's rollouts (lane 0 first, then by choice index); see the module docstring."""
    lanes: dict[int, list[dict]] = {0: []}
    for (choice, _), comp in sorted(latest_completions(state, session_id).items()):
        lanes.setdefault(choice, []).append(comp)
    main = lanes[0]
    out = [RolloutSpec(session_id, session_id, 0, tuple(main))]
    for choice in sorted(c for c in lanes if c > 0):
        first = lanes[choice][0]["turn"]
        prefix = tuple(c for c in main if c["turn"] < first)
        out.append(RolloutSpec(rollout_id(session_id, choice), session_id, choice, prefix + tuple(lanes[choice])))
    return out


def reward_choice(reward: dict) -> int | None:
    """The lane a Reward targets (its metadata's `choice_index`), or None for the whole session.

    >>> reward_choice({"metadata": {"choice_index": "2"}}), reward_choice({"metadata": {}})
    (2, None)
    """
    value = (reward.get("metadata") or {}).get("choice_index")
    return None if value is None else int(value)
