"""Composite rewards per turn, reward-to-go and group-normalized advantages (DESIGN sections 5.2, 5.3, 8).

Per turn k of a session: r_k = process_k + [k is the last turn] * (outcome + time), where
- process_k is the weighted sum of the process rules on that turn plus any grader `process` rewards for it;
- time is the task-completion-time reward of the session: among the group's successful rollouts (outcome at
  least `success_threshold`) with wall times t_i, time_i = w * (mean(t) - t_i) / (max(t) - min(t)), so faster is
  better, it sums to zero over them and lies in [-w, w]; unsuccessful rollouts, or fewer than two successful
  ones with distinct times, get 0;
- outcome is the sum of the session's grader outcome rewards.
Reward-to-go G_k = sum_{j>=k} gamma^(j-k) r_j; the advantage of a turn is (G_k - mean) / std over all turns of
the group (population std; all zero when std is 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from forge_stream.processors.rules import TurnContext, load_rule
from forge_stream.processors.settings import ProcessorSettings


@dataclass
class Turn:
    completion: dict
    process: dict[str, float] = field(default_factory=dict)  # component name -> weighted value
    outcome: float = 0.0
    time: float = 0.0
    reward: float = 0.0
    reward_to_go: float = 0.0
    advantage: float = 0.0

    @property
    def process_reward(self) -> float:
        return sum(self.process.values())


def session_turns(state: dict, session_id: str) -> list[dict]:
    """The session's completions in turn order (ties broken by completion id, so the order is deterministic)."""
    comps = [c for c in state["completions"].values() if c["session_id"] == session_id]
    return sorted(comps, key=lambda c: (c["turn"], c["completion_id"]))


def turn_spans(state: dict, completion_id: str) -> tuple[dict, ...]:
    """ToolSpans of one completion's tool calls; an explicit span replaces an inferred one for the same call."""
    by_call: dict[str, dict] = {}
    for span in sorted(state["spans"].values(), key=lambda s: (s["start_ms"], s["span_id"])):
        if span.get("completion_id") != completion_id:
            continue
        held = by_call.get(span["tool_call_id"])
        if held is None or (span["source"] == "explicit" and held["source"] != "explicit"):
            by_call[span["tool_call_id"]] = span
    return tuple(by_call.values())


def process_rewards(ctx: TurnContext, settings: ProcessorSettings) -> dict[str, float]:
    return {rule.name: rule.weight * float(load_rule(rule.path)(ctx)) for rule in settings.rules}


def wall_time_ms(state: dict, session_id: str) -> int | None:
    """SessionFinished minus SessionStarted time, else the span of the session's completions."""
    session = state["sessions"][session_id]
    if session["started_ms"] is not None and session["finished"] is not None:
        return session["finished"]["event_time"] - session["started_ms"]
    comps = session_turns(state, session_id)
    if not comps:
        return None
    return max(c["done_ms"] for c in comps) - min(c["received_ms"] for c in comps)


def time_rewards(wall_times: dict[str, int | None], outcomes: dict[str, float],
                 settings: ProcessorSettings) -> dict[str, float]:
    """Relative completion-time reward of each session (see the module docstring).

    >>> s = ProcessorSettings(time_reward_weight=0.1)
    >>> time_rewards({"a": 10, "b": 20, "c": 30, "d": 5}, {"a": 1, "b": 1, "c": 1, "d": 0}, s)
    {'a': 0.05, 'b': 0.0, 'c': -0.05, 'd': 0.0}
    """
    ok = {sid: t for sid, t in wall_times.items()
          if t is not None and outcomes.get(sid, 0.0) >= settings.success_threshold}
    out = {sid: 0.0 for sid in wall_times}
    if len(ok) < 2 or max(ok.values()) == min(ok.values()):
        return out
    mean = sum(ok.values()) / len(ok)
    spread = max(ok.values()) - min(ok.values())
    for sid, t in ok.items():
        out[sid] = settings.time_reward_weight * (mean - t) / spread
    return out


def reward_to_go(rewards: list[float], gamma: float) -> list[float]:
    """G_k = r_k + gamma * G_{k+1}.

    >>> reward_to_go([0.0, -0.5, 1.0], 0.5)
    [0.0, 0.0, 1.0]
    """
    out = [0.0] * len(rewards)
    acc = 0.0
    for k in range(len(rewards) - 1, -1, -1):
        acc = rewards[k] + gamma * acc
        out[k] = acc
    return out


def normalize(values: list[float]) -> list[float]:
    """(v - mean) / std with the population std; all zeros when there is no spread.

    >>> normalize([1.0, 3.0])
    [-1.0, 1.0]
    """
    if not values:
        return []
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    if std <= 1e-12:
        return [0.0] * len(values)
    return [(v - mean) / std for v in values]


def score_group(state: dict, session_ids: list[str], settings: ProcessorSettings) -> dict[str, list[Turn]]:
    """Composite reward, reward-to-go and advantage of every turn of the given sessions."""
    outcomes = session_outcomes(state, session_ids, settings)
    external_process: dict[tuple[str, int], float] = {}
    for reward in sorted(state["rewards"].values(), key=lambda r: r["event_id"]):
        sid = reward.get("session_id")
        if reward["kind"] == "process" and sid and reward.get("turn") is not None:
            key = (sid, reward["turn"])
            external_process[key] = external_process.get(key, 0.0) + reward["value"]
    times = time_rewards({sid: wall_time_ms(state, sid) for sid in session_ids}, outcomes, settings)

    scored: dict[str, list[Turn]] = {}
    for sid in session_ids:
        turns = []
        for comp in session_turns(state, sid):
            turn = Turn(comp, process_rewards(TurnContext(comp, turn_spans(state, comp["completion_id"])), settings))
            if (sid, comp["turn"]) in external_process:
                turn.process["grader"] = external_process[(sid, comp["turn"])]
            turns.append(turn)
        if turns:
            turns[-1].outcome, turns[-1].time = outcomes[sid], times[sid]
        for turn in turns:
            turn.reward = turn.process_reward + turn.outcome + turn.time
        for turn, g in zip(turns, reward_to_go([t.reward for t in turns], settings.gamma)):
            turn.reward_to_go = g
        scored[sid] = turns
    flat = [t for sid in session_ids for t in scored[sid]]
    for turn, adv in zip(flat, normalize([t.reward_to_go for t in flat])):
        turn.advantage = adv
    return scored


def session_outcomes(state: dict, session_ids: list[str], settings: ProcessorSettings) -> dict[str, float]:
    """Sum of each session's grader outcome rewards; `missing_outcome_reward` for an ungraded session."""
    out = {sid: [] for sid in session_ids}
    for reward in sorted(state["rewards"].values(), key=lambda r: r["event_id"]):
        if reward["kind"] == "outcome" and reward.get("session_id") in out:
            out[reward["session_id"]].append(reward["value"])
    return {sid: math.fsum(v) if v else settings.missing_outcome_reward for sid, v in out.items()}
