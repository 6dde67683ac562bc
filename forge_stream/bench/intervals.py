"""A paired bootstrap of the improvement of a trainer over several seeds, on one fixed set of test tasks.

Every seed evaluates the same test tasks before RL (its warm start) and after: `baseline[s][t]` and `final[s][t]`
are seed s's scores on task t, and the improvement on a task is `final - baseline` (paired: a task's difficulty
cancels). A bootstrap replicate resamples the seeds with replacement and, independently, the tasks with
replacement (the same resampled tasks for every seed, since every seed was scored on them all), and takes the
mean improvement over the resampled seeds and tasks; the 95% interval is the 2.5th and 97.5th percentiles of the
replicates. So the interval carries both sources of noise: which tasks were drawn, and which seeds (the warm start,
the task stream, the sampling). With few seeds the seed part is coarse (three seeds have ten distinct
resamples), which widens rather than narrows the interval only as far as the seeds actually disagree.

Tasks of one template (the same problem reworded or reordered) are not independent draws. Given `clusters` (one key
per task), a replicate resamples the clusters instead, each with all its tasks (a cluster bootstrap), and the mean is
over the tasks drawn; with every task its own cluster it is the per-task bootstrap.

>>> ci = paired_bootstrap([[0.0, 0.0, 1.0, 0.0]] * 2, [[1.0, 0.0, 1.0, 1.0]] * 2, replicates=500)
>>> ci["mean"], ci["low"] <= 0.5 <= ci["high"]
(0.5, True)
"""

from __future__ import annotations

import random
from collections import Counter


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks.

    >>> _percentile([0.0, 1.0, 2.0, 3.0, 4.0], 0.25)
    1.0
    """
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def paired_bootstrap(baseline: list[list[float]], final: list[list[float]], replicates: int = 2000,
                     seed: int = 0, level: float = 0.95, clusters: list[str] | None = None) -> dict:
    """Mean improvement (final - baseline, per task, averaged over tasks then seeds) and its bootstrap interval
    over tasks (or the `clusters` they fall in) and seeds; `baseline[s][t]` and `final[s][t]` are seed s's scores
    on test task t (every seed the same tasks, in the same order). Seeded, so a summary reproduces."""
    if not baseline or len(baseline) != len(final) or any(len(b) != len(f) or len(b) != len(baseline[0])
                                                          for b, f in zip(baseline, final)):
        raise ValueError("every seed needs a baseline and a final score for each of the same tasks")
    seeds, tasks = len(baseline), len(baseline[0])
    if tasks == 0:
        raise ValueError("no test tasks to bootstrap over")
    if clusters is not None and len(clusters) != tasks:
        raise ValueError(f"one cluster key per task: {len(clusters)} keys for {tasks} tasks")
    diff = [[f - b for b, f in zip(bs, fs)] for bs, fs in zip(baseline, final)]
    mean = sum(sum(row) for row in diff) / (seeds * tasks)
    members: dict[str, list[int]] = {}
    for t, key in enumerate(clusters if clusters is not None else range(tasks)):
        members.setdefault(key, []).append(t)
    groups = list(members.values())
    # per seed and cluster: the sum of its tasks' improvements, so a replicate costs one term per cluster drawn
    sums = [[sum(row[t] for t in group) for group in groups] for row in diff]
    rng = random.Random(seed)
    stats = []
    for _ in range(replicates):
        seed_counts = Counter(rng.choices(range(seeds), k=seeds))
        drawn = Counter(rng.choices(range(len(groups)), k=len(groups)))
        size = sum(n * len(groups[g]) for g, n in drawn.items())
        total = sum(c * sum(n * sums[s][g] for g, n in drawn.items()) for s, c in seed_counts.items())
        stats.append(total / (seeds * size))
    stats.sort()
    tail = (1 - level) / 2
    return {"mean": mean, "low": _percentile(stats, tail), "high": _percentile(stats, 1 - tail),
            "replicates": replicates, "seeds": seeds, "tasks": tasks, "clusters": len(groups)}


def tasks_for_half_width(half_width: float, p: float = 0.5, z: float = 1.959963984540054) -> int:
    """Tasks one evaluation needs for a 95% interval of +-half_width on a 0/1 mean near p (p = 0.5: the widest).

    >>> tasks_for_half_width(0.04)
    601
    >>> tasks_for_half_width(0.04, p=0.3)
    505
    """
    return int(-(-(z * z * p * (1 - p)) // (half_width * half_width)))
