"""What `forge-stream bench learning` reports: a seed's result from its two evaluations and its training steps
(`seed_result`), and the result over seeds (`summarize`), with the improvement's paired bootstrap over test tasks and
seeds, and the same by template (forge_stream.bench.intervals). forge_stream.bench.learning runs the protocol."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict

from forge_stream.bench.intervals import paired_bootstrap
from forge_stream.bench.learning_settings import LearningSettings
from forge_stream.rollout.sources import load_task_source
from forge_stream.tasks.suite import task_kind, template_key


FOOTHOLD = (0.1, 0.5)  # a kind whose baseline is in here: the warm start can do it, not reliably
WON, LOST = 0.8, 0.2  # a foothold RL took to at least WON, or let fall to at most LOST
KIND_MIN_TASKS = 5  # footholds are kinds of at least this many evaluated tasks


def describe(result: dict) -> str:
    by = {d["domain"]: d for d in result["domains"]}
    whole = by.pop("all")
    acted = result.get("acting") or {}

    def family(name: str, d: dict) -> str:
        a = acted.get(name)
        calls = f", calls {a['tool_call_rate']:.2f} valid {a['valid_call_rate']:.2f}" if a else ""
        return f"{name} {d['mean']:.2f}{calls}"

    return (f"{whole['mean']:.3f} [{whole['low']:.3f}, {whole['high']:.3f}] ("
            + "; ".join(family(name, d) for name, d in sorted(by.items())) + ")")


def describe_kinds(held: dict) -> str:
    """One line of `kinds`: where the gain came from."""
    start = held["by_start"]
    part = lambda k, what: (f"{start[k]['tasks']} tasks in kinds {what}: {start[k]['baseline']:.2f} -> "  # noqa: E731
                            f"{start[k]['final']:.2f}" if start[k]["tasks"] else f"no kind {what}")
    return (f"by kind of task: {part('below', f'the warm start could not do (< {FOOTHOLD[0]:g})')}; "
            f"{part('foothold', f'it could sometimes ({FOOTHOLD[0]:g}-{FOOTHOLD[1]:g})')} (of {held['footholds']} "
            f"such kinds RL took {held['won']} to {WON:g} or more, {held['won_by_chance']:g} by chance, and "
            f"{held['lost']} fell to {LOST:g} or less, {held['lost_by_chance']:g} by chance); "
            f"{part('above', f'it mostly could (> {FOOTHOLD[1]:g})')}")


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


def _keyed(s: LearningSettings, task_ids: list[str], key) -> list[str] | None:
    """key(domain, graded task) of each evaluated task, in task_ids' order; None when a task is not among the
    evaluation's."""
    keys = {t.task_id: key(t.domain, t.graded)
            for t in itertools.islice(load_task_source(s.test_source), s.test_tasks)}
    return [keys[t] for t in task_ids] if all(t in keys for t in task_ids) else None


def templates(s: LearningSettings, task_ids: list[str]) -> list[str] | None:
    """Each evaluated task's template (`forge_stream.tasks.suite.template_key`: one problem, whatever its wording or
    order), for the bootstrap by template; None when a task is not among the evaluation's."""
    return _keyed(s, task_ids, template_key)


def _chance(n: int, p: float, hit) -> float:
    """The chance that n tasks solved at rate p each score a mean for which hit(mean) holds."""
    return sum(math.comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1) if hit(k / n))


def kinds(s: LearningSettings, task_ids: list[str], before: list[float], after: list[float]) -> dict | None:
    """The scores by kind (`forge_stream.tasks.suite.task_kind`: a lookup key, an agent operator and answer length,
    a reasoning template), and the tasks grouped by what their kind's baseline was (`by_start`: below FOOTHOLD, in
    it, above it), which says where the gain came from.

    The footholds (kinds of at least KIND_MIN_TASKS tasks with a baseline in FOOTHOLD): how many ended at WON or more
    (`won`) and at LOST or less (`lost`), each beside the count a second evaluation of the unchanged warm start
    would give on average (`*_by_chance`: every task of a kind solved at its baseline rate). A kind's tasks are
    scored once each, so a few of them move a long way by chance alone. None when the tasks are not the suite's."""
    keys = _keyed(s, task_ids, task_kind)
    if keys is None:
        return None
    by: dict[str, list[float]] = {}
    for key, b, f in zip(keys, before, after):
        entry = by.setdefault(key, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += b
        entry[2] += f
    table = {k: {"tasks": n, "baseline": round(b / n, 4), "final": round(f / n, 4)}
             for k, (n, b, f) in sorted(by.items())}
    starts: dict[str, list[float]] = {"below": [0, 0.0, 0.0], "foothold": [0, 0.0, 0.0], "above": [0, 0.0, 0.0]}
    for n, b, f in by.values():
        start = "below" if b / n < FOOTHOLD[0] else "foothold" if b / n <= FOOTHOLD[1] else "above"
        starts[start] = [x + y for x, y in zip(starts[start], (n, b, f))]
    footholds = [v for v in table.values()
                 if v["tasks"] >= KIND_MIN_TASKS and FOOTHOLD[0] <= v["baseline"] <= FOOTHOLD[1]]
    chance = lambda hit: round(sum(_chance(v["tasks"], v["baseline"], hit) for v in footholds), 2)  # noqa: E731
    return {"by_start": {k: {"tasks": n, "baseline": round(b / n, 4) if n else None,
                             "final": round(f / n, 4) if n else None} for k, (n, b, f) in starts.items()},
            "footholds": len(footholds),
            "won": sum(v["final"] >= WON for v in footholds), "won_by_chance": chance(lambda m: m >= WON),
            "lost": sum(v["final"] <= LOST for v in footholds), "lost_by_chance": chance(lambda m: m <= LOST),
            "kinds": table}


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
        # per family, before and after: the share of sessions with a tool call, the share of those all valid, turns
        "baseline_acting": baseline.get("acting"), "final_acting": final.get("acting"),
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
        "trained_tokens": tokens, "warm_start": warm, "by_kind": kinds(s, tasks, before, after),
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
    held = [r.get("by_kind") for r in seeds]
    footholds = ({k: round(sum(h[k] for h in held), 2)
                  for k in ("footholds", "won", "won_by_chance", "lost", "lost_by_chance")} if all(held) else None)
    by_template = (f"; by template: the tasks of each of the {ci['test_templates']} templates resampled together"
                   if ci["test_templates"] else "")
    return {
        "baseline_reward": mean("baseline_reward"), "final_reward": mean("final_reward"),
        "improvement": mean("improvement"), "improvement_ci95": ci["improvement_ci95"],
        "improvement_ci95_by_template": ci["improvement_ci95_by_template"], "test_templates": ci["test_templates"],
        "interval": f"95%, paired bootstrap over {len(tasks)} {s.eval_split} tasks and {len(seeds)} seeds "
                    f"({ci['replicates']} replicates{by_template})",
        "footholds": footholds,
        "rl_minutes": max(r["rl_minutes"] for r in seeds), "loss": s.loss, "test_tasks": len(tasks),
        "eval_split": s.eval_split,
        "band": list(s.band), "seeds": seeds, "seconds_total": round(seconds, 1),
        "settings": {k: str(v) for k, v in asdict(s).items()},
    }
