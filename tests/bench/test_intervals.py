"""The paired bootstrap of `bench learning`: over test tasks and seeds, it covers the true improvement about 95% of
the time, narrows as tasks are added, and pairs each task's scores (a task's difficulty cancels)."""

import random

import pytest

from forge_stream.bench.intervals import paired_bootstrap


def experiment(rng: random.Random, tasks: int, seeds: int, gain: float, seed_sd: float = 0.03):
    """0/1 scores of `seeds` runs on the same tasks: a task's success chance p_t before, p_t + gain + the seed's
    own shift after; the true mean improvement is `gain` (shifts are centred over seeds in expectation)."""
    difficulty = [rng.uniform(0.05, 0.6) for _ in range(tasks)]
    baseline, final = [], []
    for _ in range(seeds):
        shift = rng.gauss(0.0, seed_sd)
        baseline.append([float(rng.random() < p) for p in difficulty])
        final.append([float(rng.random() < min(1.0, max(0.0, p + gain + shift))) for p in difficulty])
    return baseline, final


def test_interval_covers_the_true_improvement_about_95_percent_of_the_time():
    rng = random.Random(7)
    covered = 0
    trials = 60
    for trial in range(trials):
        baseline, final = experiment(rng, tasks=150, seeds=3, gain=0.2)
        ci = paired_bootstrap(baseline, final, replicates=400, seed=trial)
        assert ci["low"] <= ci["mean"] <= ci["high"]
        covered += ci["low"] <= 0.2 <= ci["high"]
    assert 0.85 <= covered / trials <= 1.0, covered


def test_interval_narrows_with_more_tasks():
    rng = random.Random(3)
    widths = {}
    for tasks in (100, 400, 1600):
        ci = paired_bootstrap(*experiment(rng, tasks=tasks, seeds=3, gain=0.15, seed_sd=0.0), replicates=600)
        widths[tasks] = ci["high"] - ci["low"]
    assert widths[400] < 0.7 * widths[100] and widths[1600] < 0.7 * widths[400], widths  # about 1 / sqrt(tasks)


def test_pairing_cancels_the_tasks_difficulty():
    """Every task gains exactly 0.1 whatever its difficulty: paired, the interval is the point itself; unpaired
    (the final scores of a shuffled task order) it would be wide."""
    rng = random.Random(1)
    baseline = [[rng.choice([0.0, 0.4, 0.9]) for _ in range(200)] for _ in range(2)]
    final = [[b + 0.1 for b in row] for row in baseline]
    ci = paired_bootstrap(baseline, final, replicates=300)
    assert ci["low"] == pytest.approx(0.1) and ci["high"] == pytest.approx(0.1)
    shuffled = [rng.sample(row, len(row)) for row in final]
    unpaired = paired_bootstrap(baseline, shuffled, replicates=300)
    assert unpaired["high"] - unpaired["low"] > 0.1


def test_seeds_that_disagree_widen_the_interval():
    """The same tasks, three seeds with gains 0.0, 0.2 and 0.4: resampling seeds spreads the mean."""
    baseline = [[0.0] * 300 for _ in range(3)]
    final = [[1.0 if t < 300 * gain else 0.0 for t in range(300)] for gain in (0.0, 0.2, 0.4)]
    agreeing = [[1.0 if t < 60 else 0.0 for t in range(300)] for _ in range(3)]
    wide, narrow = paired_bootstrap(baseline, final), paired_bootstrap(baseline, agreeing)
    assert wide["mean"] == pytest.approx(narrow["mean"]) == pytest.approx(0.2)
    assert wide["high"] - wide["low"] > 3 * (narrow["high"] - narrow["low"])


def test_scores_must_be_paired():
    with pytest.raises(ValueError):
        paired_bootstrap([[0.0, 1.0]], [[1.0]])
    with pytest.raises(ValueError):
        paired_bootstrap([[0.0, 1.0], [0.0]], [[1.0, 1.0], [1.0]])


def clustered_experiment(rng: random.Random, templates: int, per_template: int, p: float):
    """One seed; every task of a template gains the same: 1 with chance p (the template was learned), else 0. The
    true mean improvement is p, and the tasks of one template are one draw, not `per_template`."""
    gains = [float(rng.random() < p) for _ in range(templates)]
    keys = [f"t{k}" for k in range(templates) for _ in range(per_template)]
    final = [[gains[k] for k in range(templates) for _ in range(per_template)]]
    return [[0.0] * len(keys)], final, keys


def test_resampling_templates_covers_what_resampling_their_tasks_does_not():
    rng = random.Random(11)
    covered = {"tasks": 0, "templates": 0}
    trials = 60
    for trial in range(trials):
        baseline, final, keys = clustered_experiment(rng, templates=30, per_template=10, p=0.3)
        by_task = paired_bootstrap(baseline, final, replicates=400, seed=trial)
        by_template = paired_bootstrap(baseline, final, replicates=400, seed=trial, clusters=keys)
        assert by_template["mean"] == by_task["mean"] and by_template["clusters"] == 30
        covered["tasks"] += by_task["low"] <= 0.3 <= by_task["high"]
        covered["templates"] += by_template["low"] <= 0.3 <= by_template["high"]
    assert covered["templates"] / trials >= 0.85, covered
    assert covered["tasks"] / trials <= 0.6, covered  # 300 tasks counted as 300 draws: far too narrow


def test_every_task_its_own_template_is_the_per_task_bootstrap():
    rng = random.Random(5)
    baseline, final = experiment(rng, tasks=120, seeds=3, gain=0.1)
    plain = paired_bootstrap(baseline, final, replicates=300, seed=2)
    singletons = paired_bootstrap(baseline, final, replicates=300, seed=2, clusters=[f"k{t}" for t in range(120)])
    assert (singletons["low"], singletons["high"]) == (plain["low"], plain["high"])
    with pytest.raises(ValueError, match="one cluster key per task"):
        paired_bootstrap(baseline, final, clusters=["a", "b"])
