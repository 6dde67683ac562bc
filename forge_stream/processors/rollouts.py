"""Which completions of a session form one rollout (one trajectory of the group, one sample of the advantage).

A session's completions are indexed by (choice_index, turn); a request with n choices records n completions at
the same turn. Definitions, in the order they apply:

1. Turns, from the log. A request (one agent call, `request_id`) is one turn; a call written twice (a retry with
   the same Idempotency-Key) is one request, and of a (request, choice) written twice the later (event_time,
   completion_id) supersedes the other, which is neither trained nor scored. Two requests that carry the same turn
   number (two gateway replicas on different hosts served one session at once) are two turns: numbered in the
   order of (turn, event_time, request_id), the later ones and every turn after them moved up by one, so no call
   that was answered is lost. `latest_completions` keeps one completion per (choice_index, turn) so numbered.
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
    """(choice_index, turn) -> the session's completion for it: one per (request, choice), the later write winning,
    and the requests numbered from the turns they recorded (see the module docstring: two requests at one turn
    number are two turns; a completion renumbered so is a copy with its new `turn`)."""
    chosen: dict[tuple[str, int], dict] = {}
    for comp in state["completions"].values():
        if comp["session_id"] != session_id:
            continue
        key = (comp["request_id"], comp["choice_index"])
        held = chosen.get(key)
        if held is None or (comp["event_time"], comp["completion_id"]) > (held["event_time"], held["completion_id"]):
            chosen[key] = comp
    requests: dict[int, dict[str, tuple[int, str]]] = {}  # turn -> request id -> its order among the turn's
    for comp in chosen.values():
        at = requests.setdefault(comp["turn"], {})
        order = (comp["event_time"], comp["request_id"])
        at[comp["request_id"]] = min(at.get(comp["request_id"], order), order)
    numbered: dict[tuple[int, str], int] = {}
    moved = 0
    for turn in sorted(requests):
        for i, request in enumerate(sorted(requests[turn], key=requests[turn].get)):
            numbered[(turn, request)] = turn + moved + i
        moved += len(requests[turn]) - 1
    out: dict[tuple[int, int], dict] = {}
    for comp in chosen.values():
        turn = numbered[(comp["turn"], comp["request_id"])]
        out[(comp["choice_index"], turn)] = comp if turn == comp["turn"] else {**comp, "turn": turn}
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
