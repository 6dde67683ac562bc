"""Rollouts: n > 1 choices are sibling rollouts sharing their prefix, a call written twice is one turn, two calls at
one turn number are two, ToolSpans are waited for, evaluation groups are never trained on, and both advantage
modes."""

import math

import pytest

from forge_stream.events import encode
from forge_stream.processors import ProcessorSettings, fold
from forge_stream.processors.rewards import advantages
from forge_stream.processors.synthetic import group_events

SETTINGS = ProcessorSettings(group_timeout_ms=60_000, rules=(), time_reward_weight=0.0)
T0 = 1_700_000_000_000


def completion(sid, turn, choice, prompt, out, *, t, cid=None, temperature=0.7):
    cid = cid or f"{sid}-t{turn}-c{choice}"
    return ("Completion", {
        "event_id": cid, "event_time": t, "completion_id": cid, "session_id": sid, "group_id": "g",
        "task_id": "task", "turn": turn, "choice_index": choice, "request_id": f"req-{sid}-{turn}", "model": "m",
        "engine_id": "e", "policy_version": 1, "prompt_token_ids": prompt, "completion_token_ids": out,
        "completion_logprobs": [-0.5] * len(out), "messages_json": "[]", "tools_json": None, "output_text": "",
        "tool_calls_json": None, "finish_reason": "stop", "trainable": True, "untrainable_reason": None,
        "received_ms": t - 5, "first_token_ms": None, "done_ms": t, "agent": "", "temperature": temperature,
        "top_p": 1.0, "logprobs_mode": "processed"})


def task(group_size):
    return ("Task", {"event_id": "task", "event_time": T0, "group_id": "g", "task_id": "task", "seq": 0,
                     "domain": "qa", "grader": "x", "group_size": group_size, "prompt_json": "{}", "metadata": {}})


def started(sid, metadata=None):
    return ("SessionStarted", {"event_id": f"start-{sid}", "event_time": T0 + 1, "session_id": sid, "group_id": "g",
                               "task_id": "task", "base_url": "u", "metadata": metadata or {}})


def finished(sid, num_completions, num_tool_spans=0, t=T0 + 100):
    return ("SessionFinished", {"event_id": f"finish-{sid}", "event_time": t, "session_id": sid, "group_id": "g",
                                "task_id": "task", "status": "ok", "num_completions": num_completions,
                                "reason": None, "num_tool_spans": num_tool_spans})


def outcome(sid, value, choice=None, name="grader"):
    metadata = {} if choice is None else {"choice_index": str(choice)}
    return ("Reward", {"event_id": f"outcome-{sid}-{choice}-{name}", "event_time": T0 + 90, "group_id": "g",
                       "task_id": "task", "session_id": sid, "kind": "outcome", "name": name, "value": value,
                       "turn": None, "source": "grader", "metadata": metadata})


def run(events, settings=SETTINGS):
    state, outputs = None, []
    for schema, record in events:
        state, out = fold(state, schema, record, settings)
        outputs.extend(out)
    return state, outputs


def of(outputs, schema):
    return [e.record for e in outputs if e.schema == schema]


def best_of_three():
    """Session s: turn 0 (choice 0), then one request with n = 3 at turn 1, graded per choice."""
    return [
        task(1), started("s"),
        completion("s", 0, 0, [1, 2], [3, 4], t=T0 + 10),
        *(completion("s", 1, c, [1, 2, 3, 4, 9], [5 + c, 6], t=T0 + 20) for c in range(3)),
        outcome("s", 1.0, choice=0), outcome("s", 0.0, choice=1), outcome("s", 1.0, choice=2),
        finished("s", 4),
    ]


def test_choices_are_sibling_rollouts_sharing_the_prefix():
    state, out = run(best_of_three())
    assert state["closed"]
    trajectories = {t["choice_index"]: t for t in of(out, "Trajectory")}
    assert sorted(trajectories) == [0, 1, 2]
    for c, traj in trajectories.items():
        assert [t["completion_id"] for t in traj["turns"]] == ["s-t0-c0", f"s-t1-c{c}"]
        assert traj["turns"][-1]["outcome_reward"] == traj["outcome_reward"] == [1.0, 0.0, 1.0][c]
        assert traj["turns"][0]["outcome_reward"] == 0.0
    assert len({t["event_id"] for t in trajectories.values()}) == 3
    # Dr. GRPO (the default scale) over the three rollouts: returns 1, 0, 1 -> R - 2/3
    want = {0: 1 / 3, 1: -2 / 3, 2: 1 / 3}
    for c, traj in trajectories.items():
        assert all(t["advantage"] == pytest.approx(want[c]) for t in traj["turns"])
    [sample] = of(out, "TrainSample")
    seqs = [(s["rollout"], s["completion_id"], s["outcome_reward"]) for s in sample["sequences"]]
    assert seqs == [("s", "s-t0-c0", 1.0), ("s", "s-t1-c0", 1.0), ("s:1", "s-t0-c0", 0.0), ("s:1", "s-t1-c1", 0.0),
                    ("s:2", "s-t0-c0", 1.0), ("s:2", "s-t1-c2", 1.0)]
    assert all(s["temperature"] == 0.7 and s["logprobs_mode"] == "processed" for s in sample["sequences"])
    # the shared turn is stored once and trained with the sum of its rollouts' advantages
    assert sample["unique_tokens"] == 4 + 1 + 3 * 2 and sample["total_tokens"] == 3 * (4 + 7)
    totals = [r for r in of(out, "Reward") if r["kind"] == "total"]
    assert sorted((r["turn"], r["metadata"].get("choice_index", "")) for r in totals) == [
        (0, ""), (1, ""), (1, "1"), (1, "2")]
    for e in out:
        encode(e.schema, e.record)


def test_a_session_outcome_reaches_every_rollout():
    events = [e for e in best_of_three() if e[0] != "Reward"] + [outcome("s", 0.5)]
    _, out = run(events)
    assert [t["outcome_reward"] for t in of(out, "Trajectory")] == [0.5, 0.5, 0.5]
    assert all(t["advantage"] == 0.0 for tr in of(out, "Trajectory") for t in tr["turns"])


def test_a_retried_turn_supersedes_the_first_write():
    events = [
        task(1), started("s"),
        completion("s", 0, 0, [1, 2], [3], t=T0 + 10),
        completion("s", 1, 0, [1, 2, 3, 7], [8], t=T0 + 20, cid="first-write"),
        completion("s", 1, 0, [1, 2, 3, 7], [9], t=T0 + 30, cid="retry"),
        outcome("s", 1.0), finished("s", 2),
    ]
    _, out = run(events)
    [traj] = of(out, "Trajectory")
    assert [t["completion_id"] for t in traj["turns"]] == ["s-t0-c0", "retry"]
    assert traj["turns"][-1]["outcome_reward"] == 1.0
    [sample] = of(out, "TrainSample")
    assert [s["completion_id"] for s in sample["sequences"]] == ["s-t0-c0", "retry"]
    _, reordered = run([events[0], events[1], events[4], events[2], events[3], *events[5:]])
    assert [(e.schema, e.record) for e in reordered] == [(e.schema, e.record) for e in out]


def test_a_retry_does_not_count_as_a_missing_completion():
    events = [task(1), started("s"), completion("s", 0, 0, [1], [2], t=T0 + 10, cid="a"),
              completion("s", 0, 0, [1], [3], t=T0 + 11, cid="b"), outcome("s", 1.0), finished("s", 2)]
    state, out = run(events)
    assert out == [] and not state["closed"]  # turn 1 is still missing: two writes of turn 0 are one completion


def test_two_calls_recorded_at_one_turn_number_are_two_turns_numbered_from_the_log():
    """Two gateway replicas served one session at once and both recorded turn 1 (two requests): the session's
    count (3) is met, both calls are trained, numbered 1 and 2 by (turn, event_time), the next turn moved to 3;
    the same whatever order the records arrive in."""
    def call(turn, cid, t, request):
        _, record = completion("s", turn, 0, [1, 2], [t % 100], t=t, cid=cid)
        return ("Completion", {**record, "request_id": request})

    events = [task(1), started("s"), call(0, "a", T0 + 10, "ra"), call(1, "on-b", T0 + 22, "rb"),
              call(1, "on-a", T0 + 21, "rc"), call(2, "next", T0 + 30, "rd"), outcome("s", 1.0), finished("s", 4)]
    _, out = run(events)
    [traj] = of(out, "Trajectory")
    assert [(t["completion_id"], t["turn"]) for t in traj["turns"]] == [("a", 0), ("on-a", 1), ("on-b", 2),
                                                                        ("next", 3)]
    [sample] = of(out, "TrainSample")
    assert [s["completion_id"] for s in sample["sequences"]] == ["a", "on-a", "on-b", "next"]
    _, reordered = run([*events[:2], events[3], events[5], events[2], events[4], *events[6:]])
    assert [(e.schema, e.record) for e in reordered] == [(e.schema, e.record) for e in out]


def encoded_sample(events):
    _, out = run(events, ProcessorSettings(group_timeout_ms=60_000))
    [sample] = of(out, "TrainSample")
    return encode("TrainSample", sample)


def test_the_sample_waits_for_the_sessions_tool_spans():
    events = group_events("g", group_size=2, turns=3)
    spans = [e for e in events if e[0] == "ToolSpan"]
    assert spans and all(e[1]["status"] for e in spans)
    rest = [e for e in events if e[0] != "ToolSpan"]
    before = encoded_sample(events)  # spans before the finish
    after = encoded_sample(rest + spans)  # the spans arrive after the sessions finished and were graded
    assert after == before


def test_an_explicit_span_wins_over_an_inferred_one_in_any_order():
    events = group_events("g", group_size=2, turns=2)
    [(_, inferred)] = [e for e in events if e[0] == "ToolSpan" and e[1]["session_id"] == "g-s1"]
    explicit = {**inferred, "event_id": "explicit", "source": "explicit", "status": "error", "error": "boom"}
    assert inferred["status"] == "ok"
    rest = [e for e in events if e[0] != "ToolSpan" or e[1] is not inferred]
    a = encoded_sample([("ToolSpan", inferred), ("ToolSpan", explicit)] + rest)
    b = encoded_sample([("ToolSpan", explicit), ("ToolSpan", inferred)] + rest)
    c = encoded_sample([("ToolSpan", inferred)] + rest)
    assert a == b != c


@pytest.mark.parametrize("eval_at", [0, 3, None])
def test_evaluation_groups_emit_nothing(eval_at):
    """Also when the SessionStarted is read after the group's other events (at the latest before its finish)."""
    events = [e for e in group_events("g", group_size=2, turns=2) if e[0] != "SessionStarted"]
    eval_start = started("g-s0", {"purpose": "eval"})
    at = eval_at if eval_at is not None else next(i for i, e in enumerate(events) if e[0] == "SessionFinished")
    state, out = run(events[:at] + [eval_start] + events[at:])
    assert out == [] and state["closed"]
    assert set(state) == {"group_id", "partition", "closed", "closed_ms"}


def test_advantage_modes():
    rewards = [[0.0, 1.0], [0.0, 0.0, 0.0], [0.5], []]
    rollout = advantages(rewards, 1.0, "rollout")
    returns = [1.0, 0.0, 0.5]
    mean = sum(returns) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 3)
    assert rollout == [pytest.approx([(r - mean) / std] * len(rw)) for r, rw in zip(returns + [0], rewards)]
    turn = advantages(rewards, 0.5, "turn")
    togo = [0.5, 1.0, 0.0, 0.0, 0.0, 0.5]
    mean = sum(togo) / 6
    std = math.sqrt(sum((g - mean) ** 2 for g in togo) / 6)
    assert [a for r in turn for a in r] == pytest.approx([(g - mean) / std for g in togo])
    assert advantages([[1.0], [1.0, 0.0]], 1.0, "rollout") == [[0.0], [0.0, 0.0]]  # no spread


def test_advantage_setting_reaches_the_sample():
    events = group_events("g", group_size=3, turns=3)
    by_mode = {}
    for mode in ("rollout", "turn"):
        _, out = run(events, ProcessorSettings(group_timeout_ms=60_000, advantage=mode))
        by_mode[mode] = {t["completion_id"]: t["advantage"] for tr in of(out, "Trajectory") for t in tr["turns"]}
    per_session = {}
    for cid, adv in by_mode["rollout"].items():
        per_session.setdefault(cid.rsplit("-c", 1)[0], set()).add(adv)
    assert all(len(advs) == 1 for advs in per_session.values())  # one advantage per rollout
    assert by_mode["rollout"] != by_mode["turn"]


def test_a_reward_delivered_twice_with_one_event_id_counts_once():
    """A retried reward post with an Idempotency-Key is the same event id (the gateway derives it from the key);
    the group counts it once, while a second reward with its own id adds up."""
    events = [task(2), started("a"), started("b"),
              completion("a", 0, 0, [1, 2], [3], t=T0 + 10), completion("b", 0, 0, [1, 2], [4], t=T0 + 10),
              outcome("a", 1.0), outcome("a", 1.0), outcome("b", 0.5), outcome("b", 0.25, name="bonus"),
              finished("a", 1), finished("b", 1)]
    _, out = run(events)
    outcomes = {t["session_id"]: t["outcome_reward"] for t in of(out, "Trajectory")}
    assert outcomes == {"a": 1.0, "b": 0.75}
