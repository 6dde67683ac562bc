"""Reward-to-go and group normalization against a direct computation; the time reward's bounds."""

import math

from hypothesis import given, settings as hsettings, strategies as st

from forge_stream.processors.rewards import normalize, reward_to_go, time_rewards
from forge_stream.processors.settings import ProcessorSettings

finite = st.floats(min_value=-10, max_value=10, allow_nan=False)


@hsettings(max_examples=200, deadline=None)
@given(sessions=st.lists(st.lists(finite, min_size=1, max_size=6), min_size=1, max_size=6),
       gamma=st.floats(min_value=0.0, max_value=1.0))
def test_advantages_match_direct_computation(sessions, gamma):
    direct = [[sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))] for r in sessions]
    flat = [g for gs in direct for g in gs]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((g - mean) ** 2 for g in flat) / len(flat))

    ours = [reward_to_go(r, gamma) for r in sessions]
    for got, want in zip(ours, direct):
        assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(got, want))
    advantages = normalize([g for gs in ours for g in gs])
    if std > 1e-6:
        want_adv = [(g - mean) / std for g in flat]
        assert all(math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) for a, b in zip(advantages, want_adv))
        assert math.isclose(sum(advantages) / len(advantages), 0.0, abs_tol=1e-9)
        assert math.isclose(sum(a * a for a in advantages) / len(advantages), 1.0, rel_tol=1e-6)
    elif std == 0.0:
        assert advantages == [0.0] * len(flat)


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.tuples(st.integers(0, 10_000), st.booleans()),
                       min_size=1, max_size=8))
def test_time_reward_bounded_faster_is_better(rollouts):
    cfg = ProcessorSettings(time_reward_weight=0.25)
    times = {sid: t for sid, (t, _) in rollouts.items()}
    outcomes = {sid: 1.0 if ok else 0.0 for sid, (_, ok) in rollouts.items()}
    got = time_rewards(times, outcomes, cfg)
    assert all(-0.25 - 1e-12 <= v <= 0.25 + 1e-12 for v in got.values())
    assert all(got[sid] == 0.0 for sid, (_, ok) in rollouts.items() if not ok)
    ok = [sid for sid, (_, good) in rollouts.items() if good]
    assert math.isclose(sum(got[s] for s in ok), 0.0, abs_tol=1e-9)
    for a in ok:
        for b in ok:
            if times[a] < times[b]:
                assert got[a] > got[b]


def test_advantage_scale_none_keeps_sub_outcome_differences_small():
    """A group that always succeeds differs only by its time rewards (at most +-0.1). Dividing by the group's std
    blows that up to the size of a success signal; without it (Dr. GRPO) the group weighs what its rewards say."""
    from forge_stream.processors.rewards import advantages

    solved = [[1.0 + 0.1], [1.0 - 0.1], [1.0 + 0.02], [1.0 - 0.02]]
    mixed = [[1.0], [0.0], [0.0], [0.0]]
    by_std = advantages(solved, 1.0, "rollout", "std")
    by_mean = advantages(solved, 1.0, "rollout", "none")
    assert max(abs(a[0]) for a in by_std) > 1.0  # as loud as a success in a mixed group
    assert max(abs(a[0]) for a in by_mean) <= 0.1 + 1e-9
    mixed_by_mean = advantages(mixed, 1.0, "rollout", "none")
    assert mixed_by_mean[0][0] == 0.75 and mixed_by_mean[1][0] == -0.25
    assert math.isclose(sum(a[0] for a in mixed_by_mean), 0.0, abs_tol=1e-12)
    turns = advantages([[0.0, 1.0], [0.0, 0.0]], 1.0, "turn", "none")
    assert turns == [[0.5, 0.5], [-0.5, -0.5]]


def _sample_advantages(settings: ProcessorSettings) -> list[float]:
    """The advantages of a synthetic group whose 4 rollouts all succeed in different wall times (no process rules)."""
    from forge_stream.processors import fold
    from forge_stream.processors.synthetic import group_events

    state, sample = None, None
    for schema, record in group_events("g", group_size=4, turns=1):
        if schema == "Reward":
            record = {**record, "value": 1.0}
        state, out = fold(state, schema, record, settings)
        sample = next((e.record for e in out if e.schema == "TrainSample"), sample)
    return [ref["advantage"] for ref in sample["sequences"]]


def test_the_time_reward_is_opt_in():
    """Wall time on busy shared cores is noise. By default a group whose outcomes are all equal carries no signal,
    however its wall times differ, with or without the std division; a user who opts in gets the faster rollouts
    pushed up."""
    for scale in ("none", "std"):
        assert _sample_advantages(ProcessorSettings(rules=(), advantage_scale=scale)) == [0.0] * 4
    opted = _sample_advantages(ProcessorSettings(rules=(), time_reward_weight=0.1))
    assert opted[0] > 0 > opted[-1] and abs(sum(opted)) < 1e-9  # rollout 0 was the fastest, rollout 3 the slowest
    assert ProcessorSettings().time_reward_weight == 0.0


def test_the_processors_command_takes_the_time_reward_weight(monkeypatch):
    import topologies.processors
    from typer.testing import CliRunner

    from forge_stream.cli import app
    from forge_stream.cli import processors as command

    seen = []
    monkeypatch.setattr(command, "ready_kafka", lambda cfg, wait=False: None)
    monkeypatch.setattr(topologies.processors, "run_worker", lambda config, loglevel: seen.append(config.processors))
    for extra in ([], ["--time-reward-weight", "0.1"]):
        result = CliRunner().invoke(app, ["processors", "run", "--bootstrap-servers", "127.0.0.1:1", *extra])
        assert result.exit_code == 0, result.output
    assert [s.time_reward_weight for s in seen] == [0.0, 0.1]
