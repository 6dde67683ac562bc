"""The processors' fold: `fold(state, schema, record) -> (state, outputs)` and `expire(state, now_ms)`.

This is the whole processing logic of a rollout group, free of Kafka: the faust topology in `topologies/`
only decodes, calls these and sends what they return. Outputs carry deterministic ids and times derived from
the group's events, so a replay re-emits identical records:
- one Trajectory per included session   (id: deterministic_id("trajectory", group_id, session_id));
- Reward components (kind process / time / total) (id: deterministic_id("reward", group, session, turn, kind, name));
- one TrainSample per group               (id: deterministic_id("sample", group_id)).
Their event_time is the group's last event time when it completes, or its deadline when it times out.
"""

from __future__ import annotations

from dataclasses import dataclass

from forge_stream.events import deterministic_id
from forge_stream.processors import groups
from forge_stream.processors.rewards import Turn, score_group, session_outcomes, wall_time_ms
from forge_stream.processors.sample import build_sample, trainable
from forge_stream.processors.settings import ProcessorSettings
from forge_stream.topics import TOPICS, Topic


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
    if groups.is_complete(state):
        return close(state, complete=True, settings=settings)
    return state, []


def expire(state: dict | None, now_ms: int, settings: ProcessorSettings) -> tuple[dict | None, list[Emit]]:
    """Close an open group whose deadline passed; forget a closed marker after `forget_closed_ms`."""
    if state is None or not groups.due(state, now_ms, settings):
        return state, []
    if state["closed"]:
        return None, []
    return close(state, complete=False, settings=settings)


def close(state: dict, complete: bool, settings: ProcessorSettings) -> tuple[dict, list[Emit]]:
    """Score the done sessions, emit rewards, trajectories and the sample; shrink the state to a closed marker."""
    closed_ms = state["last_ms"] if complete else groups.deadline_ms(state, settings)
    done = groups.done_sessions(state)
    missing = sorted(set(state["sessions"]) - set(done))
    scored = score_group(state, done, settings)
    task = state["task"]
    gid = state["group_id"]
    task_id = task["task_id"] if task else _task_id(state)
    task_seq = task["seq"] if task else -1
    emits = _reward_events(gid, task_id, scored, closed_ms, settings)
    outcomes = session_outcomes(state, done, settings)
    for sid in done:
        emits.append(Emit(TOPICS.trajectories, gid, "Trajectory", {
            "event_id": deterministic_id("trajectory", gid, sid), "event_time": closed_ms,
            "group_id": gid, "task_id": task_id, "task_seq": task_seq, "session_id": sid,
            "status": state["sessions"][sid]["finished"]["status"], "outcome_reward": outcomes[sid],
            "wall_time_ms": wall_time_ms(state, sid), "turns": [_turn_record(t) for t in scored[sid]],
            "group_complete": complete, "missing_sessions": missing,
        }))
    if task is not None:
        sample = build_sample([t for sid in done for t in scored[sid]], {
            "event_id": deterministic_id("sample", gid), "event_time": closed_ms, "group_id": gid,
            "task_id": task_id, "task_seq": task_seq, "domain": task["domain"], "group_complete": complete,
        })
        if sample is not None:
            emits.append(Emit(TOPICS.samples, gid, "TrainSample", sample))
    return groups.closed_marker(state, closed_ms), emits


def _task_id(state: dict) -> str:
    for record in (*state["completions"].values(), *state["rewards"].values()):
        return record["task_id"]
    return ""


def _turn_record(turn: Turn) -> dict:
    comp = turn.completion
    return {
        "completion_id": comp["completion_id"], "turn": comp["turn"], "agent": comp.get("agent", ""),
        "prompt_tokens": len(comp["prompt_token_ids"]), "completion_tokens": len(comp["completion_token_ids"]),
        "trainable": trainable(comp), "outcome_reward": turn.outcome, "process_reward": turn.process_reward,
        "time_reward": turn.time, "reward": turn.reward, "reward_to_go": turn.reward_to_go,
        "advantage": turn.advantage,
    }


def _reward_events(gid: str, task_id: str, scored: dict[str, list[Turn]], closed_ms: int,
                   settings: ProcessorSettings) -> list[Emit]:
    """Every nonzero process component, each session's time reward and every turn's composite total."""
    def reward(sid: str, turn: int | None, kind: str, name: str, value: float) -> Emit:
        return Emit(TOPICS.rewards, gid, "Reward", {
            "event_id": deterministic_id("reward", gid, sid, turn, kind, name), "event_time": closed_ms,
            "group_id": gid, "task_id": task_id, "session_id": sid, "kind": kind, "name": name,
            "value": value, "turn": turn, "source": settings.source, "metadata": {},
        })

    out = []
    for sid, turns in scored.items():
        for t in turns:
            k = t.completion["turn"]
            out.extend(reward(sid, k, "process", name, v) for name, v in sorted(t.process.items()) if v != 0.0)
            out.append(reward(sid, k, "total", "composite", t.reward))
        if turns:
            out.append(reward(sid, None, "time", "completion_time", turns[-1].time))
    return out
