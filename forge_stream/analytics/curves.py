"""Reward curves of one training run: series built from its TrainStep and EvalResult history, and their picture.

The training series are per optimizer step: the batch's mean outcome reward (with an exponentially smoothed line)
and its mean composite reward. The evaluation series are per domain: held-out mean reward with its 95% confidence
interval, placed on the step axis where that policy version appeared. Step s trains from version v and publishes
version v + 1, so version v sits at the step of the TrainStep that trained from it (x = v for a run that started
at version 0). Records are de-duplicated by `event_id`; when a step or an evaluation appears twice, the later one
wins.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

from forge_stream.kafka.history import Slice, read_slice
from forge_stream.topics import TOPICS

EVAL_COLORS = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


@dataclass(frozen=True)
class TrainSeries:
    step: list[int] = field(default_factory=list)
    outcome_reward: list[float] = field(default_factory=list)
    outcome_reward_smoothed: list[float] = field(default_factory=list)
    mean_reward: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class EvalSeries:
    x: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    mean_reward: list[float] = field(default_factory=list)
    ci_low: list[float] = field(default_factory=list)
    ci_high: list[float] = field(default_factory=list)
    episodes: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RewardCurves:
    run: str
    train: TrainSeries
    evals: dict[str, EvalSeries]

    def to_json(self) -> dict:
        return asdict(self)


def smooth(values: list[float], weight: float = 0.6) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased so the first point is not pulled to 0.

    >>> smooth([1.0, 1.0, 1.0])
    [1.0, 1.0, 1.0]
    >>> [round(v, 3) for v in smooth([0.0, 1.0], weight=0.5)]
    [0.0, 0.667]
    """
    out, last = [], 0.0
    for i, value in enumerate(values):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight ** (i + 1)))
    return out


def eval_x(version: int, step_of_version: dict[int, int]) -> int:
    """Where policy `version` sits on the step axis.

    >>> eval_x(3, {0: 0, 1: 1, 2: 2, 3: 3})  # trained from at step 3
    3
    >>> eval_x(4, {0: 0, 1: 1, 2: 2, 3: 3})  # the last version, published by step 3
    4
    >>> eval_x(7, {10: 0})  # a run resumed at version 10: version 7 came before it
    7
    """
    if version in step_of_version:
        return step_of_version[version]
    if version - 1 in step_of_version:
        return step_of_version[version - 1] + 1
    return version


def _unique(records: Iterable[dict]) -> list[dict]:
    seen: dict[str, dict] = {}
    for record in records:
        seen[record["event_id"]] = record
    return sorted(seen.values(), key=lambda r: r["event_time"])


def build_curves(run: str, train_steps: Iterable[dict], evals: Iterable[dict], smoothing: float = 0.6) -> RewardCurves:
    """The run's series from its TrainStep and EvalResult records (already filtered to the run)."""
    by_step = {r["step"]: r for r in _unique(train_steps)}
    steps = [by_step[s] for s in sorted(by_step)]
    outcome = [r["outcome_reward"] for r in steps]
    train = TrainSeries([r["step"] for r in steps], outcome, smooth(outcome, smoothing),
                        [r["mean_reward"] for r in steps])
    step_of_version: dict[int, int] = {}
    for r in steps:
        step_of_version.setdefault(r["policy_version"], r["step"])
    latest: dict[tuple[str, int], dict] = {}
    for r in _unique(e for e in evals if e["split"] == "heldout"):
        latest[(r["domain"], r["policy_version"])] = r
    series: dict[str, EvalSeries] = {}
    for (domain, version), r in sorted(latest.items()):
        s = series.setdefault(domain, EvalSeries())
        s.x.append(eval_x(version, step_of_version))
        s.policy_version.append(version)
        s.mean_reward.append(r["mean_reward"])
        s.ci_low.append(r["ci_low"])
        s.ci_high.append(r["ci_high"])
        s.episodes.append(r["episodes"])
    return RewardCurves(run, train, series)


def load_curves(bootstrap: str, run: str | None = None, smoothing: float = 0.6) -> RewardCurves:
    """Read forge.train_metrics and forge.evals from the beginning; without `run`, the run that trained last."""
    steps = list(read_slice(bootstrap, TOPICS.train_metrics, Slice()))
    if run is None:
        if not steps:
            raise LookupError("forge.train_metrics is empty: no run to plot")
        run = max(steps, key=lambda e: e.record["event_time"]).key
    evals = [e.record for e in read_slice(bootstrap, TOPICS.evals, Slice()) if e.record["run"] == run]
    return build_curves(run, [e.record for e in steps if e.key == run], evals, smoothing)


def plot_curves(curves: RewardCurves, out: Path, title: str | None = None) -> None:
    """Draw the curves into an image file (its format from the suffix), without a display."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=120, layout="constrained")
    ax = fig.subplots()
    train = curves.train
    if train.step:
        ax.plot(train.step, train.outcome_reward, color="tab:blue", alpha=0.3, linewidth=1,
                label="rollout outcome reward")
        ax.plot(train.step, train.outcome_reward_smoothed, color="tab:blue", linewidth=2,
                label="rollout outcome reward (smoothed)")
        ax.plot(train.step, train.mean_reward, color="tab:gray", linestyle="--", linewidth=1,
                label="composite reward")
    for (domain, s), color in zip(curves.evals.items(), itertools.cycle(EVAL_COLORS)):
        # a Wilson bound can round a hair past a mean of 0 or 1: matplotlib refuses negative error bars
        below = [max(0.0, m - lo) for m, lo in zip(s.mean_reward, s.ci_low)]
        above = [max(0.0, hi - m) for m, hi in zip(s.mean_reward, s.ci_high)]
        ax.errorbar(s.x, s.mean_reward, yerr=[below, above], fmt="o-", capsize=4, markersize=5, color=color,
                    label=f"held-out eval: {domain} (95% CI)")
    ax.set_xlabel("training step (evaluations at the step their policy version appeared)")
    ax.set_ylabel("reward")
    ax.set_title(title or f"rewards of run {curves.run}")
    ax.grid(alpha=0.3)
    if train.step or curves.evals:
        ax.legend(loc="best", fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
