"""What `forge-stream bench learning` reports: a seed's result from its two evaluations and its training steps
(`seed_result`), and the result over seeds (`summarize`), with the improvement's paired bootstrap over test tasks and
seeds, and the same by template (forge_stream.bench.intervals). forge_stream.bench.learning runs the protocol."""

from __future__ import annotations

import itertools
from dataclasses import asdict
from typing import TYPE_CHECKING

from forge_stream.bench.intervals import paired_bootstrap
from forge_stream.rollout.sources import load_task_source
from forge_stream.tasks.suite import template_key

if TYPE_CHECKING:
    from forge_stream.bench.learning import LearningSettings


def describe(result: dict) -> str:
    by = {d["domain"]: d for d in result["domains"]}
    whole = by.pop("all")
    return (f"{whole['mean']:.3f} [{whole['low']:.3f}, {whole['high']:.3f}] ("
            + ", ".join(f"{name} {d['mean']:.2f}" for name, d in sorted(by.items())) + ")")


def overall(result: dict) -> dict:
    return next(d for d in result["domains"] if d["domain"] == "all")


def per_task(result: dict) -> dict[str, float]:
    """An evaluation's score per task (the mean of its episodes; a failed one scores 0)."""
    by: dict[str, list[float]] = {}
    for o in result["outcomes"]:
        by.setdefault(o["task_id"], []).append(o["reward"])
    return {task: sum(rewards) / len(rewards) for task, rewards in by.items()}


def paired_scores(baseline: dict, final: dict) -> tuple[list[str], list[float], list[float]]:
    """The tasks both evaluations scored, in one order, with each one's scores; raises if they scored different
    tasks (a comparison over other tasks is no paired comparison)."""
    before, after = per_task(baseline), per_task(final)
    if set(before) != set(after):
        raise RuntimeError(f"the evaluations before and after RL scored different test tasks "
                           f"({len(set(before) ^ set(after))} differ)")
    tasks = sorted(before)
    return tasks, [before[t] for t in tasks], [after[t] for t in tasks]


def templates(s: LearningSettings, task_ids: list[str]) -> list[str] | None:
    """Each evaluated task's template (`forge_stream.tasks.suite.template_key`: one problem, whatever its wording or
    order), for the bootstrap by template; None when a task is not among the evaluation's."""
    keys = {t.task_id: template_key(t.domain, t.graded)
            for t in itertools.islice(load_task_source(s.test_source), s.test_tasks)}
    return [keys[t] for t in task_ids] if all(t in keys for t in task_ids) else None


def intervals(s: LearningSettings, baseline: list[list[float]], final: list[list[float]], task_ids: list[str],
              seed: int) -> dict:
    """The improvement's 95% interval over tasks and seeds (`improvement_ci95`), and the same with the tasks of one
    template resampled together (`improvement_ci95_by_template`, `test_templates`; None if the templates are not
    known)."""
    ci = paired_bootstrap(baseline, final, replicates=s.bootstrap_replicates, seed=seed)
    keys = templates(s, task_ids)
    by = keys and paired_bootstrap(baseline, final, replicates=s.bootstrap_replicates, seed=seed, clusters=keys)
    return {"improvement_ci95": [ci["low"], ci["high"]],
            "improvement_ci95_by_template": [by["low"], by["high"]] if by else None,
            "test_templates": by["clusters"] if by else None, "replicates": ci["replicates"]}


def seed_result(s: LearningSettings, seed: int, warm: dict, baseline: dict, final: dict, steps: list[dict],
             rl_minutes: float, served: int | None) -> dict:
    base, end = overall(baseline), overall(final)
    tasks, before, after = paired_scores(baseline, final)
    ci = intervals(s, [before], [after], tasks, seed)
    tokens = sum(st["total_tokens"] for st in steps)
    return {
        "seed": seed, "baseline_reward": base["mean"], "final_reward": end["mean"],
        "improvement": end["mean"] - base["mean"], "improvement_ci95": ci["improvement_ci95"],
        "improvement_ci95_by_template": ci["improvement_ci95_by_template"], "test_templates": ci["test_templates"],
        "baseline_ci": [base["low"], base["high"]], "final_ci": [end["low"], end["high"]],
        "baseline_by_domain": {d["domain"]: d["mean"] for d in baseline["domains"] if d["domain"] != "all"},
        "final_by_domain": {d["domain"]: d["mean"] for d in final["domains"] if d["domain"] != "all"},
        "rl_minutes": round(rl_minutes, 2), "steps": len(steps), "groups_trained": sum(st["groups"] for st in steps),
        "groups_without_signal": sum(st.get("groups_without_signal", 0) for st in steps),
        "rollouts_trained": sum(st["rollouts"] for st in steps), "final_policy_version": served,
        "test_tasks": len(tasks), "loss": s.loss,
        "mismatch_mean": sum(st["mismatch_mean"] for st in steps) / len(steps) if steps else None,
        "mismatch_max": max((st["mismatch_max"] for st in steps), default=None),
        "clip_fraction_mean": sum(st["clip_fraction"] for st in steps) / len(steps) if steps else None,
        "staleness_mean": sum(st["staleness_mean"] for st in steps) / len(steps) if steps else None,
        "staleness_max": max((st["staleness_max"] for st in steps), default=None),
        "train_outcome_reward_first": steps[0]["outcome_reward"] if steps else None,
        "train_outcome_reward_last": steps[-1]["outcome_reward"] if steps else None,
        "trained_tokens": tokens, "warm_start": warm,
        "per_task": {"task_ids": tasks, "baseline": before, "final": after},
    }


def summarize(s: LearningSettings, seeds: list[dict], seconds: float) -> dict:
    """The result over seeds: means, the paired bootstrap over test tasks and seeds, and each seed's result."""
    tasks = seeds[0]["per_task"]["task_ids"]
    if any(r["per_task"]["task_ids"] != tasks for r in seeds):
        raise RuntimeError("the seeds were evaluated on different test tasks")
    ci = intervals(s, [r["per_task"]["baseline"] for r in seeds], [r["per_task"]["final"] for r in seeds], tasks,
                   s.seed)
    mean = lambda key: sum(r[key] for r in seeds) / len(seeds)  # noqa: E731
    by_template = (f"; by template: the tasks of each of the {ci['test_templates']} templates resampled together"
                   if ci["test_templates"] else "")
    return {
        "baseline_reward": mean("baseline_reward"), "final_reward": mean("final_reward"),
        "improvement": mean("improvement"), "improvement_ci95": ci["improvement_ci95"],
        "improvement_ci95_by_template": ci["improvement_ci95_by_template"], "test_templates": ci["test_templates"],
        "interval": f"95%, paired bootstrap over {len(tasks)} {s.eval_split} tasks and {len(seeds)} seeds "
                    f"({ci['replicates']} replicates{by_template})",
        "rl_minutes": max(r["rl_minutes"] for r in seeds), "loss": s.loss, "test_tasks": len(tasks),
        "eval_split": s.eval_split,
        "band": list(s.band), "seeds": seeds, "seconds_total": round(seconds, 1),
        "settings": {k: str(v) for k, v in asdict(s).items()},
    }
