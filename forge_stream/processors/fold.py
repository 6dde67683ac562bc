"""The processors' fold: `fold(state, schema, record) -> (state, outputs)` and `expire(state, now_ms)`.

This is the whole processing logic of a rollout group, free of Kafka: the faust topology in `topologies/`
only decodes, calls these and sends what they return. Outputs carry deterministic ids and times derived from
the group's events, so a replay re-emits identical records:
- one Trajectory per rollout of an included session (forge_stream.processors.rollouts: the session's main line
  and one sibling per extra choice of an n > 1 request) (id: deterministic_id("trajectory", group_id, rollout));
- Reward components (kind process / time / total) of each rollout's own turns, metadata {"choice_index": c}
  for a sibling rollout (id: deterministic_id("reward", group, rollout, turn, kind, name));
- one TrainSample per group               (id: deterministic_id("sample", group_id)), or, when the group has no
  trainable completion (all its sessions failed or were lost, or its Task never came), one GroupSkipped with the
  reason (id: deterministic_id("group_skipped", group_id)) on the same topic, so the trainer does not wait on it.
Completions are read with their prompts whole (`whole_prompts`): a prompt recorded by reference is rebuilt from the
group's other completions, so the outputs are the same as if every prompt had been recorded whole.
A group is *cut* before it completes when it goes idle (no event for the group timeout: `expire`) or outgrows its
size bound (at the event that passes it: `fold`); it then closes with the sessions that finished, and when that gives
no sample its GroupSkipped says which cut it was (`cut`: "idle_timeout" or "size_bound", "" for a group that closed
complete) and why, in words (`reason`).
Their event_time is the group's last event time when it completes or outgrows its bound, or its deadline when it
goes idle.
An evaluation group (a session started with metadata {"purpose": "eval"}) emits nothing: its state becomes a
closed marker as soon as that SessionStarted is read, dropping whatever arrived before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from forge_stream.events import deterministic_id
from forge_stream.events.prompts import MissingReference, prefix_breaks, resolve_prompt, whole
from forge_stream.processors import groups
from forge_stream.processors.rewards import Rollout, Turn, score_group, wall_time_ms
from forge_stream.processors.sample import build_sample, trainable
from forge_stream.processors.settings import ProcessorSettings
from forge_stream.topics import TOPICS, Topic


Cut = Literal["idle_timeout", "size_bound"]


@dataclass(frozen=True)
class Emit:
    topic: Topic
    key: str
    schema: str
    record: dict


def fold(state: dict | None, schema: str, record: dict, settings: ProcessorSettings,
         partition: int | None = None) -> tuple[dict | None, list[Emit]]:
    """Apply one input event to its group. Raises groups.InvalidEvent for a record that must go to the DLQ."""
    groups.validate(schema, record)
    if state is not None and state["closed"]:
        return state, []
    if schema == "Reward" and record["source"] == settings.source:
        return state, []
    state = groups.apply(state or groups.new_group(record["group_id"], partition), schema, record, settings)
    if groups.is_eval_start(schema, record):
        return groups.closed_marker(state, state["last_ms"]), []
    if groups.is_complete(state):
        return close(state, settings)
    if schema == "Completion" and (why := groups.over_size(state, settings)):
        return close(state, settings, "size_bound", why)
    return state, []


def expire(state: dict | None, now_ms: int, settings: ProcessorSettings) -> tuple[dict | None, list[Emit]]:
    """Cut an open group that has been idle past its deadline; forget a closed marker after `forget_closed_ms`."""
    if state is None or not groups.due(state, now_ms, settings):
        return state, []
    if state["closed"]:
        return None, []
    return close(state, settings, "idle_timeout", f"no event for {settings.group_timeout_ms / 1000:g} s")


def close(state: dict, settings: ProcessorSettings, cut: Cut | None = None,
          why: str = "") -> tuple[dict, list[Emit]]:
    """Score the done sessions, emit rewards, trajectories and the sample; shrink the state to a closed marker.
    `cut` says what closed a group that is not complete, `why` the details."""
    complete = cut is None
    closed_ms = groups.deadline_ms(state, settings) if cut == "idle_timeout" else state["last_ms"]
    state = {**state, "completions": whole_prompts(state["completions"])}
    done = groups.done_sessions(state)
    missing = sorted(set(state["sessions"]) - set(done))
    rollouts = score_group(state, done, settings)
    task = state["task"]
    gid = state["group_id"]
    task_id = task["task_id"] if task else _task_id(state)
    task_seq = task["seq"] if task else -1
    emits = _reward_events(gid, task_id, rollouts, closed_ms, settings)
    for r in rollouts:
        breaks = prefix_breaks([t.completion for t in r.turns])
        emits.append(Emit(TOPICS.trajectories, gid, "Trajectory", {
            "event_id": deterministic_id("trajectory", gid, r.rollout_id), "event_time": closed_ms,
            "group_id": gid, "task_id": task_id, "task_seq": task_seq, "session_id": r.session_id,
            "choice_index": r.choice_index, "status": state["sessions"][r.session_id]["finished"]["status"],
            "outcome_reward": r.outcome, "wall_time_ms": wall_time_ms(state, r.session_id),
            "turns": [_turn_record(t, b) for t, b in zip(r.turns, breaks)], "group_complete": complete,
            "missing_sessions": missing, "prefix_breaks": sum(b > 0 for b in breaks),
            "tool_call_failures": sum(t.completion.get("tool_call_error") is not None for t in r.turns),
        }))
    sample = None if task is None else build_sample(rollouts, {
        "event_id": deterministic_id("sample", gid), "event_time": closed_ms, "group_id": gid,
        "task_id": task_id, "task_seq": task_seq, "domain": task["domain"], "group_complete": complete,
    })
    if sample is not None:
        emits.append(Emit(TOPICS.samples, gid, "TrainSample", sample))
    else:
        emits.append(Emit(TOPICS.samples, gid, "GroupSkipped", {
            "event_id": deterministic_id("group_skipped", gid), "event_time": closed_ms, "group_id": gid,
            "task_id": task_id, "task_seq": task_seq, "reason": _skip_reason(state, done, missing, cut, why),
            "group_complete": complete, "missing_sessions": missing, "cut": cut or "",
        }))
    return groups.closed_marker(state, closed_ms), emits


def whole_prompts(completions: dict[str, dict]) -> dict[str, dict]:
    """The group's completions with their prompt ids rebuilt whole (a prompt recorded by reference extends a
    completion of its own session, so of this group). One whose reference never arrived (its group timed out) is
    kept untrainable, with the reason."""
    cache: dict = {}
    out = {}
    for cid, comp in completions.items():
        try:
            out[cid] = whole(comp, *resolve_prompt(comp, completions, cache, messages=False))
        except MissingReference as exc:
            out[cid] = {**comp, "trainable": False, "untrainable_reason": str(exc)}
    return out


def _skip_reason(state: dict, done: list[str], missing: list[str], cut: Cut | None, why: str) -> str:
    """Why a closed group has no sample, in words: what cut it (if anything did), then what it lacked."""
    cut_by = {"idle_timeout": f"cut when idle ({why})", "size_bound": f"cut at its size bound ({why})"}.get(cut)
    if state["task"] is None:
        lacked = "its Task never reached the processors"
    elif not done:
        lacked = f"no session finished ({len(missing)} started)"
    else:
        failed = sum(state["sessions"][sid]["finished"]["status"] != "ok" for sid in done)
        lacked = (f"no trainable completion in its {len(done)} finished sessions ({failed} failed"
                  f"{f', {len(missing)} unfinished' if missing else ''})")
    return f"{cut_by}: {lacked}" if cut_by else lacked


def _task_id(state: dict) -> str:
    for record in (*state["completions"].values(), *state["rewards"].values()):
        return record["task_id"]
    return ""


def _turn_record(turn: Turn, prefix_break: int) -> dict:
    comp = turn.completion
    return {"prefix_break_tokens": prefix_break,
        "completion_id": comp["completion_id"], "turn": comp["turn"], "agent": comp.get("agent", ""),
        "prompt_tokens": len(comp["prompt_token_ids"]), "completion_tokens": len(comp["completion_token_ids"]),
        "trainable": trainable(comp), "outcome_reward": turn.outcome, "process_reward": turn.process_reward,
        "time_reward": turn.time, "reward": turn.reward, "reward_to_go": turn.reward_to_go,
        "advantage": turn.advantage, "tool_call_error": comp.get("tool_call_error"),
    }


def _reward_events(gid: str, task_id: str, rollouts: list[Rollout], closed_ms: int,
                   settings: ProcessorSettings) -> list[Emit]:
    """Every nonzero process component and the composite total of each rollout's own turns (a shared prefix
    turn is reported once, by lane 0), and each rollout's time reward."""
    def reward(r: Rollout, turn: int | None, kind: str, name: str, value: float) -> Emit:
        return Emit(TOPICS.rewards, gid, "Reward", {
            "event_id": deterministic_id("reward", gid, r.rollout_id, turn, kind, name), "event_time": closed_ms,
            "group_id": gid, "task_id": task_id, "session_id": r.session_id, "kind": kind, "name": name,
            "value": value, "turn": turn, "source": settings.source,
            "metadata": {"choice_index": str(r.choice_index)} if r.choice_index else {},
        })

    out = []
    for r in rollouts:
        for t in r.own_turns:
            k = t.completion["turn"]
            out.extend(reward(r, k, "process", name, v) for name, v in sorted(t.process.items()) if v != 0.0)
            out.append(reward(r, k, "total", "composite", t.reward))
        if r.turns:
            out.append(reward(r, None, "time", "completion_time", r.time))
    return out
