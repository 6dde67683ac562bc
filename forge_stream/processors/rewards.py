"""Composite rewards per turn, reward-to-go and group advantages over rollouts (DESIGN sections 5.2, 5.3, 8).

The unit is the rollout (forge_stream.processors.rollouts: a session's main line, or a sibling choice of an
n > 1 request with its shared prefix). Per turn k of a rollout: r_k = process_k + [k is its last turn] *
(outcome + time), where
- process_k is the weighted sum of the process rules on that turn plus any grader `process` rewards for it
  (a grader reward whose metadata has `choice_index` targets that choice's completion, else choice 0's);
- time is the task-completion-time reward of the rollout, off unless the user opts in (`time_reward_weight` w,
  default 0: wall time on busy shared cores is noise, and in a group whose outcomes are all equal it would be
  the only signal): among the group's successful rollouts (outcome at least `success_threshold`) with wall
  times t_i (their session's), time_i = w * (mean(t) - t_i) / (max(t) - min(t)), so faster is better, it sums
  to zero over them and lies in [-w, w]; unsuccessful rollouts, or fewer than two successful ones with
  distinct times, get 0;
- outcome is the sum of the grader outcome rewards of its session that target the whole session or its lane
  (metadata `choice_index`); `missing_outcome_reward` when there is none.
Advantages (`ProcessorSettings.advantage`):
- "rollout" (default, GRPO): each rollout's return R_i = sum_k r_k; A_i = (R_i - mean(R)) / std(R) over the
  group's rollouts that have turns (population std; all zero when std is 0); every turn of rollout i gets A_i.
- "turn": reward-to-go G_k = sum_{j>=k} gamma^(j-k) r_j per rollout, normalized over all turns of the group's
  rollouts (mean 0, std 1, all zero when std is 0).
A turn of a shared prefix is scored in each rollout that contains it, with that rollout's advantage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from forge_stream.processors.rollouts import RolloutSpec, reward_choice, session_rollouts
from forge_stream.processors.rules import TurnContext, load_rule
from forge_stream.processors.settings import AdvantageMode, AdvantageScale, ProcessorSettings


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


@dataclass
class Rollout:
    """One scored rollout: its turns (shared prefix included) and its outcome and time rewards."""

    rollout_id: str
    session_id: str
    choice_index: int
    turns: list[Turn]
    outcome: float = 0.0
    time: float = 0.0

    @property
    def own_turns(self) -> list[Turn]:
        """The turns that are this lane's own completions (not the borrowed lane-0 prefix)."""
        return [t for t in self.turns if t.completion["choice_index"] == self.choice_index]


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
    comps = [c for c in state["completions"].values() if c["session_id"] == session_id]
    if not comps:
        return None
    return max(c["done_ms"] for c in comps) - min(c["received_ms"] for c in comps)


def time_rewards(wall_times: dict[str, int | None], outcomes: dict[str, float],
                 settings: ProcessorSettings) -> dict[str, float]:
    """Relative completion-time reward of each session (see the module docstring).

    >>> s = ProcessorSettings(time_reward_weight=0.1)
    >>> time_rewards({"a": 10, "b": 20, "c": 30, "d": 5}, {"a": 1, "b": 1, "c": 1, "d": 0}, s)
    {'a': 0.05, 'b': 0.0, 'c': -0.05, 'd': 0.0}
    >>> time_rewards({"a": 10, "b": 20}, {"a": 1, "b": 1}, ProcessorSettings())  # off unless opted in
    {'a': 0.0, 'b': 0.0}
    """
    ok = {sid: t for sid, t in wall_times.items()
          if t is not None and outcomes.get(sid, 0.0) >= settings.success_threshold}
    out = {sid: 0.0 for sid in wall_times}
    if not settings.time_reward_weight or len(ok) < 2 or max(ok.values()) == min(ok.values()):
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


def normalize(values: list[float], scale: AdvantageScale = "std") -> list[float]:
    """v - mean, divided by the population std when `scale` is "std" (all zeros when there is no spread).

    >>> normalize([1.0, 3.0])
    [-1.0, 1.0]
    >>> normalize([1.0, 3.0], "none")
    [-1.0, 1.0]
    >>> [round(v, 3) for v in normalize([1.0, 1.1, 1.0, 0.9], "std")]  # a 0.1 spread blown up to a success's size
    [0.0, 1.414, 0.0, -1.414]
    >>> [round(v, 3) for v in normalize([1.0, 1.1, 1.0, 0.9], "none")]
    [0.0, 0.1, 0.0, -0.1]
    """
    if not values:
        return []
    mean = math.fsum(values) / len(values)
    if scale == "none":
        return [v - mean for v in values]
    if scale != "std":
        raise ValueError(f"unknown advantage scale {scale!r} (std or none)")
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    if std <= 1e-12:
        return [0.0] * len(values)
    return [(v - mean) / std for v in values]


def advantages(rewards: list[list[float]], gamma: float, mode: AdvantageMode,
               scale: AdvantageScale = "std") -> list[list[float]]:
    """Per-turn advantages of a group's rollouts from their per-turn composite rewards (module docstring).

    >>> advantages([[0.25, 0.75], [0.0, 0.0]], 1.0, "rollout")
    [[1.0, 1.0], [-1.0, -1.0]]
    >>> advantages([[0.25, 0.75], [0.0, 0.0]], 1.0, "rollout", "none")
    [[0.5, 0.5], [-0.5, -0.5]]
    >>> advantages([[1.0], [0.0, 0.0, 0.0], []], 1.0, "rollout")
    [[1.0], [-1.0, -1.0, -1.0], []]
    >>> [[round(a, 3) for a in r] for r in advantages([[1.0], [0.0, 0.0, 0.0]], 1.0, "turn")]
    [[1.732], [-0.577, -0.577, -0.577]]
    """
    if mode == "rollout":
        scored = [i for i, r in enumerate(rewards) if r]
        returns = dict(zip(scored, normalize([math.fsum(rewards[i]) for i in scored], scale)))
        return [[returns[i]] * len(r) if r else [] for i, r in enumerate(rewards)]
    if mode != "turn":
        raise ValueError(f"unknown advantage mode {mode!r} (rollout or turn)")
    togo = [reward_to_go(r, gamma) for r in rewards]
    flat = iter(normalize([g for gs in togo for g in gs], scale))
    return [[next(flat) for _ in gs] for gs in togo]


def score_group(state: dict, session_ids: list[str], settings: ProcessorSettings) -> list[Rollout]:
    """Composite reward, reward-to-go and advantage of every turn of the given sessions' rollouts."""
    specs = [spec for sid in session_ids for spec in session_rollouts(state, sid)]
    outcomes = rollout_outcomes(state, specs, settings)
    external_process: dict[tuple[str, int, int], float] = {}
    for reward in sorted(state["rewards"].values(), key=lambda r: r["event_id"]):
        sid = reward.get("session_id")
        if reward["kind"] == "process" and sid and reward.get("turn") is not None:
            key = (sid, reward_choice(reward) or 0, reward["turn"])
            external_process[key] = external_process.get(key, 0.0) + reward["value"]
    times = time_rewards({s.rollout_id: wall_time_ms(state, s.session_id) for s in specs}, outcomes, settings)

    rollouts = []
    for spec in specs:
        turns = []
        for comp in spec.completions:
            context = TurnContext(comp, turn_spans(state, comp["completion_id"]), state.get("task"))
            turn = Turn(comp, process_rewards(context, settings))
            key = (spec.session_id, comp["choice_index"], comp["turn"])
            if key in external_process:
                turn.process["grader"] = external_process[key]
            turns.append(turn)
        rollout = Rollout(spec.rollout_id, spec.session_id, spec.choice_index, turns,
                          outcomes[spec.rollout_id], times[spec.rollout_id])
        if turns:
            turns[-1].outcome, turns[-1].time = rollout.outcome, rollout.time
        for turn in turns:
            turn.reward = turn.process_reward + turn.outcome + turn.time
        for turn, g in zip(turns, reward_to_go([t.reward for t in turns], settings.gamma)):
            turn.reward_to_go = g
        rollouts.append(rollout)
    per_turn = advantages([[t.reward for t in r.turns] for r in rollouts], settings.gamma, settings.advantage,
                          settings.advantage_scale)
    for rollout, advs in zip(rollouts, per_turn):
        for turn, adv in zip(rollout.turns, advs):
            turn.advantage = adv
    return rollouts


def rollout_outcomes(state: dict, specs: list[RolloutSpec], settings: ProcessorSettings) -> dict[str, float]:
    """Sum of each rollout's grader outcome rewards; `missing_outcome_reward` for an ungraded rollout."""
    out: dict[str, list[float]] = {s.rollout_id: [] for s in specs}
    lanes = {(s.session_id, s.choice_index): s.rollout_id for s in specs}
    for reward in sorted(state["rewards"].values(), key=lambda r: r["event_id"]):
        sid = reward.get("session_id")
        if reward["kind"] != "outcome" or not sid:
            continue
        choice = reward_choice(reward)
        for (session, lane), rid in lanes.items():
            if session == sid and choice in (None, lane):
                out[rid].append(reward["value"])
    return {rid: math.fsum(v) if v else settings.missing_outcome_reward for rid, v in out.items()}
