"""`forge-stream bench learning`: the proof that the whole pipeline learns, over several seeds, with an interval.

For each seed (`--seeds N`: seeds S, S+1, ..., one after another) on a fresh home it builds the tiny model, warm-starts
it on the scripted teacher's demonstrations (`sft`, until its held-out criterion reaches a target within a step
budget), starts the local topology (its own Kafka broker unless given one, the engine on the warm model, the
gateway, the processors and the trainer), evaluates the test split through the gateway with the black-box example
agent (`forge-stream eval`), trains by RL for a fixed wall-clock budget while the rollout controller drives the same
agent over the seed's stream of training tasks, stops the rollouts, lets the engine load the last policy and
evaluates the same test tasks again. Every step is the command a user would run; the evaluations are EvalResults on
forge.evals and the steps TrainSteps on forge.train_metrics, so the curve is data (`--plot` draws it with the code
of `forge-stream plot rewards`).

The warm starts run first, all of them, so that a seed whose warm start misses the band fails the run before any RL.
A warm start must land in a band of held-out reward (`band`, about 0.1 to 0.5): below it RL has almost no successes
to reinforce, above it little room to show a gain. The bench refuses (`OutsideBand`) when the SFT criterion, or the
measured held-out reward of the warm start, is outside, unless told to go on (`allow_outside_band`).

With `model` (a model directory, or a known name such as smollm2-135m, imported on first use) the run starts from
that pretrained model instead: no tiny model and no SFT (the band is checked on its measured test reward), the
training and test tasks are those of `mix` (the suite's `PRETRAINED_MIX` by default: families chosen by the model's
measured baseline, see forge_stream/tasks/suite.py), sampled at `temperature` (0.7 by default there: the trainer
scores each token at the temperature it was sampled at), and the engine is vLLM unless told otherwise.

With `lora_rank` the trainer trains a LoRA adapter and the engine serves each adapter version
(forge_stream.lora). Every seed's result reports how fast versions reached the rollouts, for full fine-tuning and
LoRA alike: `sync_bytes`, `sync_s` and the versions counted (forge_stream.bench.policy_sync), `switch_s` (the
engine's own count, from its /health: publication to the engine serving the version, median and max, before any
answer under it has had time to finish), beside `staleness_mean`. `service_restarts` names each service the
supervisor restarted during the seed, with how often (empty when none was).

The summary (forge_stream.bench.learning_result) keeps every test task's score before and after RL per seed, and the
improvement's 95% interval is a paired bootstrap over test tasks and seeds (forge_stream.bench.intervals);
`improvement_ci95_by_template` resamples the tasks of one template together (five single digits to order one way are
one problem in any order; the reasoning family has 440 templates in the test split, 21 before 2026-12-07). `test_tasks` defaults to 600: a 0/1 mean
near 0.5 then has a 95% interval of +-0.040 in one evaluation (`tasks_for_half_width(0.04)` is 601).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import httpx
from confluent_kafka import KafkaException

from forge_stream.bench.cpu import CpuParts, cpu_used, proc_tree_cpu, processes
from forge_stream.bench.learning_result import describe, describe_kinds, overall, seed_result, summarize
from forge_stream.bench.policy_sync import sync_summary
from forge_stream.bench.learning_settings import LearningSettings
from forge_stream.deploy import Topology, up
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.rollout.recovery import CONTROLLER_KEY
from forge_stream.services import Supervisor
from forge_stream.settings import ForgeSettings
from forge_stream.shipped import command_line
from forge_stream.topics import TOPICS

AGENT = command_line("python examples/agents/tool_agent.py --serve")


SUBGOAL_RULE = "forge_stream.processors.rules.tool_result_answers"
PARTIAL_CREDIT_RULE = "forge_stream.processors.rules.answer_prefix"


class OutsideBand(Exception):
    """A warm start outside the band: no RL was started. `result` is what the bench prints (`refused` says why)."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def _cli(*args: str, env: dict[str, str]) -> dict:
    """Run a forge-stream command that prints one JSON object; its progress goes to our stderr."""
    done = subprocess.run([sys.executable, "-m", "forge_stream", *args, "--json"], env=env, stdout=subprocess.PIPE,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"forge-stream {' '.join(args[:2])} failed with exit code {done.returncode}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def run_name(seed: int) -> str:
    return f"bench-learning-seed{seed}"


def _train_steps(bootstrap: str, run: str) -> list[dict]:
    steps = {e.record["event_id"]: e.record for e in read_slice(bootstrap, TOPICS.train_metrics, Slice())
             if e.key == run}
    return sorted(steps.values(), key=lambda r: r["step"])


def _submitted_groups(bootstrap: str, run: str) -> list[dict]:
    """The Task records the bench's controller (named after the run) published."""
    return [e.record for e in read_slice(bootstrap, TOPICS.tasks, Slice())
            if e.record["metadata"].get(CONTROLLER_KEY) == run]


def _first_rollout_ms(bootstrap: str, since_ms: int) -> int | None:
    """When the first training session started (SessionStarted on forge.sessions from `since_ms`, evals left out)."""
    return min((e.record["event_time"] for e in read_slice(bootstrap, TOPICS.sessions, Slice(start_ms=since_ms))
                if "base_url" in e.record and e.record["metadata"].get("purpose") != "eval"), default=None)


def _policy_versions(bootstrap: str, run: str) -> list[dict]:
    return [e.record for e in read_slice(bootstrap, TOPICS.policy, Slice()) if e.key == run]


def _latest_policy(bootstrap: str, run: str) -> int:
    return max((record["version"] for record in _policy_versions(bootstrap, run)), default=0)


def _served_version(engine_url: str) -> int | None:
    """The policy version the engine serves, from its /health (the one route that needs no engine token); None while
    it does not answer (e.g. restarting under its supervisor).

    >>> _served_version("http://127.0.0.1:9") is None
    True
    """
    try:
        return httpx.get(f"{engine_url}/health", timeout=10).json().get("policy_version")
    except httpx.TransportError:
        return None


def _engine_loads(engine_url: str) -> dict:
    """The engine's weight-load counts from its /health (loads, failed_loads, and vLLM's renamed_versions) and its
    publication-to-serving seconds (switch_s); {} from an engine that keeps none or does not answer."""
    try:
        health = httpx.get(f"{engine_url}/health", timeout=10).json()
    except (httpx.TransportError, ValueError):
        return {}
    return {key: health[key] for key in ("loads", "renamed_versions", "failed_loads", "switch_s")
            if health.get(key) is not None}


SERVE_WAIT_S = 120.0  # how long the bench waits, after RL, for the engine to serve the last version


def _wait_served(engine_url: str, version: int, timeout_s: float = SERVE_WAIT_S) -> int | None:
    deadline = time.monotonic() + timeout_s
    served = _served_version(engine_url)
    while (served is None or served < version) and time.monotonic() < deadline:
        time.sleep(1.0)
        served = _served_version(engine_url)
    return served


def _advice(value: float, band: tuple[float, float]) -> str:
    if value < band[0]:
        return ("raise --sft-max-steps or --sft-target (or try --sft-lr), or pass --allow-outside-band to run RL "
                "anyway")
    return "lower --sft-target, or pass --allow-outside-band to run RL anyway"


def check_band(what: str, value: float, band: tuple[float, float]) -> str | None:
    """None inside the band, else the one-line reason and what to do.

    >>> check_band("seed 3's warm start: held-out reward", 0.02, (0.1, 0.5))[:68]
    "seed 3's warm start: held-out reward 0.020 is outside the band [0.10"
    >>> check_band("x", 0.3, (0.1, 0.5)) is None
    True
    """
    if band[0] <= value <= band[1]:
        return None
    return (f"{what} {value:.3f} is outside the band [{band[0]:.2f}, {band[1]:.2f}] a warm start must land in "
            f"before RL: {_advice(value, band)}")


SFT_KEYS = ("steps", "max_steps", "target", "family_target", "balanced", "reached", "predicted_reward", "by_family",
            "heldout_nll", "heldout_examples", "examples", "final_loss", "seconds", "curve")


def _sft(s: LearningSettings, seed: int, base: Path, home: Path, env: dict[str, str],
         progress: Callable[[str], None]) -> dict:
    """SFT of `base` into `home`/warm on the mix's demonstrations, as s says (the `sft` command); its summary."""
    balanced = ", half of each batch from those short of it" if s.sft_balanced else ""
    each = "" if s.sft_family_target is None else f", each family's {s.sft_family_target:g}{balanced}"
    progress(f"[seed {seed}] warm start: SFT on demonstrations of {s.mix} until held-out predicted reward "
             f"{s.sft_target:g}{each} (at most {s.sft_max_steps} steps, {s.sft_examples} demonstrations)")
    sft = _cli("sft", "--model", str(base), "--out", str(home / "warm"), "--max-steps", str(s.sft_max_steps),
               "--target", str(s.sft_target), "--examples", str(s.sft_examples), "--lr", str(s.sft_lr),
               "--family-target", str(-1 if s.sft_family_target is None else s.sft_family_target),
               "--ceiling", str(round(max(s.band[1] - 0.05, s.sft_target), 4)),  # under the band's top
               "--batch-size", str(s.sft_batch_size), "--check-every", str(s.sft_check_every),
               "--check-examples", str(s.sft_check_examples),
               "--balanced" if s.sft_balanced else "--no-balanced",
               "--seed", str(seed), "--mix", s.mix, env=env)
    families = ", ".join(f"{f} {v:.3f}" for f, v in sft["by_family"].items())
    progress(f"[seed {seed}] warm start: {sft['steps']} steps, held-out predicted reward "
             f"{sft['predicted_reward']:.3f} ({families}), SFT loss {sft['final_loss']:.3f} ({sft['seconds']:.0f}s)")
    return {k: sft[k] for k in SFT_KEYS}


def reused_warm_start(result_path: Path, seed: int) -> dict:
    """Seed `seed`'s warm start as an earlier run's result (`bench learning --json`, its --home kept) records it,
    with `reused_from`: two settings compared from one start, and no SFT run twice.

    Raises ValueError, saying what to do, when the file is no such result, lacks the seed, or its model is gone."""
    try:
        result = json.loads(Path(result_path).read_text())
        runs = {int(run["seed"]): run for run in result.get("seeds") or []}
        if "warm_start" in result:  # a run refused at a seed's band: that seed's warm start is kept too
            runs.setdefault(int(result["seed"]), result)
        home = (result.get("settings") or {}).get("home")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"--warm-from {result_path}: not the JSON of a bench learning run ({exc})") from None
    if not runs:
        raise ValueError(f"--warm-from {result_path}: not the JSON of a bench learning run (it names no seed)")
    if seed not in runs:
        raise ValueError(f"--warm-from {result_path}: that run has no seed {seed} (its seeds: {sorted(runs)}); "
                         f"give --seed and --seeds within them")
    warm = dict(runs[seed].get("warm_start") or {})
    model_dir = warm.get("model_dir") or (str(Path(home) / f"seed{seed}" / "warm") if home else None)
    if not model_dir or not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"--warm-from {result_path}: seed {seed}'s warm start ({model_dir}) is gone; run the "
                         f"first benchmark with --home DIR to keep its warm starts")
    return {**warm, "model_dir": model_dir, "reused_from": str(result_path)}


def warm_start(s: LearningSettings, seed: int, home: Path, progress: Callable[[str], None] = print) -> dict:
    """The seed's tiny model (its own init) and its SFT warm start in `home`; the `sft` command's summary. With a
    pretrained `model`: that model, as it is, or (with `pretrained_sft`) after the same SFT. With `warm_from`: the
    warm start that earlier run made for this seed."""
    if s.warm_from:
        home.mkdir(parents=True, exist_ok=True)
        warm = reused_warm_start(s.warm_from, seed)
        progress(f"[seed {seed}] warm start: the one {s.warm_from} made ({warm['model_dir']})")
        return warm
    env = {**os.environ, "FORGE_HOME": str(home)}
    if s.model:
        from forge_stream.model_import import resolve_model

        model_dir = resolve_model(s.model, ForgeSettings().cache_dir, progress)
        if not s.pretrained_sft:
            progress(f"[seed {seed}] starting from the pretrained model {s.model} ({model_dir}): no warm start")
            return {"pretrained": s.model, "model_dir": str(model_dir)}
        return {"pretrained": s.model, "model_dir": str(home / "warm"), **_sft(s, seed, model_dir, home, env, progress)}
    _cli("model", "init", "--out", str(home / "init"), "--seed", str(seed), "--hidden-size", str(s.hidden_size),
         "--layers", str(s.layers), env=env)
    return _sft(s, seed, home / "init", home, env, progress)


def run(s: LearningSettings, progress: Callable[[str], None] = print) -> dict:
    """Every seed's warm start, then every seed's evaluation, RL and evaluation; the summary over seeds. Raises
    OutsideBand (before that seed's RL) when a warm start misses the band and `allow_outside_band` is off."""
    root = s.home or Path(tempfile.mkdtemp(prefix="forge-bench-learning-"))
    seeds = [s.seed + i for i in range(s.seeds)]
    started = time.monotonic()
    try:
        warm = {}
        for seed in seeds:
            warm[seed] = warm_start(s, seed, root / f"seed{seed}", progress)
            if s.model:  # no SFT criterion: the band is checked on the test evaluation
                continue
            reason = check_band(f"seed {seed}'s warm start: SFT's held-out predicted reward",
                                warm[seed]["predicted_reward"], s.band)
            if reason and not s.allow_outside_band:
                raise OutsideBand(reason, {"refused": reason, "seed": seed, "warm_start": warm[seed],
                                           "band": list(s.band)})
        results = []
        for i, seed in enumerate(seeds):
            progress(f"[seed {seed}] RL run {i + 1} of {len(seeds)}")
            try:
                results.append(run_seed(s, seed, root / f"seed{seed}", warm[seed], progress))
            except OutsideBand as exc:
                exc.result["seeds"] = results
                raise
        return summarize(s, results, time.monotonic() - started)
    except Exception as exc:
        if s.home is None and not isinstance(exc, OutsideBand):  # a refusal says all; a failure needs the logs
            kept = keep_logs(root)
            if kept:
                progress(f"the run failed: its services' logs are kept in {kept} (the rest of its fresh home is "
                         f"removed; --home DIR keeps all of it)")
        raise
    finally:
        if s.home is None:
            shutil.rmtree(root, ignore_errors=True)


def keep_logs(root: Path) -> Path | None:
    """Copy every service log of the seeds' homes under `root` (SEED/run/*.log) to a new folder beside it, keeping
    their paths below `root`; the folder, or None when there was no log."""
    logs = sorted(root.glob("*/run/*.log"))
    if not logs:
        return None
    kept = Path(tempfile.mkdtemp(prefix="forge-bench-learning-logs-"))
    for log in logs:
        target = kept / log.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(log, target)
    return kept


def rules(s: LearningSettings) -> list[str]:
    """The process rules the processors get on top of their defaults (each 'path=weight')."""
    weights = ((SUBGOAL_RULE, s.subgoal_reward), (PARTIAL_CREDIT_RULE, s.partial_credit))
    return [f"{path}={weight}" for path, weight in weights if weight]


def run_seed(s: LearningSettings, seed: int, home: Path, warm: dict,
             progress: Callable[[str], None] = print) -> dict:
    """One seed's evaluation of its warm start, RL and evaluation, on a topology of its own in `home`."""
    ports = {name: free_port() for name in ("kafka_port", "kafka_controller_port", "registry_port", "engine_port",
                                             "gateway_port", "kv_tier_port", "kv_tier_http_port")}
    cfg = ForgeSettings(home=home, bootstrap_servers=s.bootstrap, **ports)
    env = {**os.environ, "FORGE_HOME": str(home), **{f"FORGE_{k.upper()}": str(v) for k, v in ports.items()}}
    if s.bootstrap:
        env["FORGE_BOOTSTRAP_SERVERS"] = s.bootstrap
    run_id = run_name(seed)
    tag = f"[seed {seed}]"
    gateway_url = f"http://127.0.0.1:{cfg.gateway_port}"
    engine_url = f"http://127.0.0.1:{cfg.engine_port}"
    model = warm.get("model_dir") or str(home / "warm")
    try:
        progress(f"{tag} [1/5] starting the topology in {home}")
        services = ["kv_tier"] * bool(s.kv_tier) + ["engine", "gateway", "processors", "trainer"]
        topology = Topology("bench-learning", services, {
            "kv_tier": {"kind": s.kv_tier},
            "engine": {"kind": s.engine, "model": model, "max_batch_size": s.concurrency, "policy_run": run_id,
                       "replicas": s.engines,
                       **({"threads": 1} if s.engine == "torch" else {}),
                       **({"lora_rank": s.lora_rank} if s.lora_rank and s.engine == "vllm" else {}),
                       **({"load_interval": s.engine_load_interval} if s.engine_load_interval else {})},
            "gateway": {},
            "processors": {"group_timeout_s": 120, "advantage": "rollout", "advantage_scale": s.advantage_scale,
                           "rules": rules(s)},
            "trainer": {"model": model, "run": run_id, "batch_size": s.batch_size, "lr": s.lr, "loss": s.loss,
                        "updates_per_batch": s.updates_per_batch,
                        "window": 0.3, "rollout_slots": s.concurrency // s.group_size, "wait_s": 5,
                        "group_timeout": 300, "threads": 1, **({"lora_rank": s.lora_rank} if s.lora_rank else {})},
        })
        up(cfg, topology, echo=progress)
        evaluate = ("eval", "--tasks", s.test_source, "--limit", str(s.test_tasks), "--agent", AGENT,
                    "--agent-workers", str(s.agent_workers), "--concurrency", str(s.concurrency), "--run", run_id,
                    "--gateway-url", gateway_url, "--bootstrap-servers", cfg.bootstrap)
        progress(f"{tag} [2/5] {s.eval_split} evaluation of the warm start ({s.test_tasks} tasks)")
        baseline = _cli(*evaluate, env=env)
        progress(f"{tag}   {s.eval_split} reward {describe(baseline)}")
        reason = check_band(f"seed {seed}'s warm start: {s.eval_split} reward", overall(baseline)["mean"], s.band)
        if reason and not s.allow_outside_band:
            raise OutsideBand(reason, {"refused": reason, "seed": seed, "warm_start": warm, "band": list(s.band),
                                       "baseline_reward": overall(baseline)["mean"]})
        progress(f"{tag} [3/5] RL for {s.rl_minutes:g} minutes ({s.loss}, lr {s.lr:g}, {s.batch_size} groups x "
                 f"G={s.group_size} a step)")
        supervisor = Supervisor(cfg.run_dir)
        cpu_before = _cpu_by_service(cfg)
        rl_started, rl_started_ms = time.monotonic(), int(time.time() * 1000)
        from forge_stream import credentials
        from forge_stream.builders import controller_service
        from forge_stream.deploy import credentials_env

        controller = controller_service(cfg, {
            "tasks": s.training_source(seed), "agent": AGENT, "agent_workers": s.agent_workers,
            "agent_per_worker": -(-s.concurrency // s.agent_workers), "concurrency": s.concurrency,
            "group_size": s.group_size, "name": run_id, "loop": True,
            **({"replay_edge": s.replay_edge} if s.replay_edge else {})})
        # the gateway `up` started takes sessions opened with the deployment's admin token only
        supervisor.start(replace(controller, env={**controller.env,
                                                  **credentials_env("controller", credentials.load(cfg.home))}))
        deadline = rl_started + s.rl_minutes * 60
        shown = 0
        while time.monotonic() < deadline:
            time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
            try:
                steps = _train_steps(cfg.bootstrap, run_id)
            except KafkaException as exc:  # the progress lines only: a busy broker answers at the next poll
                progress(f"{tag}   (no progress line this time: reading {TOPICS.train_metrics.name} failed: {exc})")
                continue
            for step in steps[shown:]:
                progress(f"{tag}   step {step['step']}: outcome reward {step['outcome_reward']:.3f}, "
                         f"loss {step['loss']:.4f}, mismatch {step['mismatch_mean']:.4f}, groups {step['groups']}")
            shown = len(steps)
        cpu_parts = cpu_used(cpu_before, _cpu_by_service(cfg))
        cpu = {name: round(sum(parts.values()), 1) for name, parts in cpu_parts.items()}
        progress(f"{tag}   CPU seconds used during RL, by service: {cpu}")
        progress(f"{tag} [4/5] stopping the rollouts and the trainer; the engine loads the last policy")
        supervisor.stop("controller", timeout=120)
        stopped_ms = int(time.time() * 1000)
        supervisor.stop("trainer", timeout=120)
        last = _latest_policy(cfg.bootstrap, run_id)
        served = _wait_served(engine_url, last)
        if served is None:
            raise EngineGone(f"{tag} the engine at {engine_url} did not answer for {SERVE_WAIT_S:.0f} s after RL "
                             f"stopped, so the trained policy cannot be evaluated: read "
                             f"{cfg.run_dir / 'engine.log'}")
        engine_loads = _engine_loads(engine_url)
        progress(f"{tag} [5/5] {s.eval_split} evaluation of policy v{served}")
        final = _cli(*evaluate, "--policy-version", str(served), env=env)
        progress(f"{tag}   {s.eval_split} reward {describe(final)}")
        steps = _train_steps(cfg.bootstrap, run_id)
        if not steps:
            raise NothingTrained(f"{tag} no training step in {s.rl_minutes:g} minutes of RL, so there is no gain "
                                 f"to report: the rollouts never reached the trainer; read "
                                 f"{cfg.run_dir / 'controller.log'} and {cfg.run_dir / 'trainer.log'}")
        first_ms = _first_rollout_ms(cfg.bootstrap, rl_started_ms) or rl_started_ms
        rl_minutes = ((steps[-1]["event_time"] if steps else stopped_ms) - first_ms) / 60000
        if s.plot:
            from forge_stream.analytics.curves import load_curves, plot_curves

            path = s.plot if s.seeds == 1 else s.plot.with_name(f"{s.plot.stem}-seed{seed}{s.plot.suffix}")
            plot_curves(load_curves(cfg.bootstrap, run_id), path,
                        f"forge-stream bench learning, seed {seed} ({s.loss}, {rl_minutes:.1f} min RL on 2 CPU cores)")
        summary = seed_result(s, seed, warm, baseline, final, steps, rl_minutes, served)
        if summary["by_kind"]:
            progress(f"{tag}   {describe_kinds(summary['by_kind'])}")
        rollouts = summary["rollouts_trained"]
        submitted = _submitted_groups(cfg.bootstrap, run_id)
        answered = [e.record for e in read_slice(cfg.bootstrap, TOPICS.completions,
                                                 Slice(start_ms=rl_started_ms, end_ms=stopped_ms))]
        sync = sync_summary(_policy_versions(cfg.bootstrap, run_id), answered)
        switch = engine_loads.pop("switch_s", None)
        progress(f"{tag}   policy sync: {sync}, switch_s {switch}")
        restarts = service_restarts(cfg)
        if restarts:
            progress(f"{tag}   services restarted by the supervisor during the run: {restarts} (their logs in "
                     f"{cfg.run_dir} say why)")
        return {**summary, "engine": s.engine, "engine_loads": engine_loads, "lora_rank": s.lora_rank, **sync,
                "engines": s.engines, "kv_tier": s.kv_tier, "prompt_sources": prompt_sources(answered),
                "switch_s": switch, "service_restarts": restarts,
                **({"engine_load_interval": s.engine_load_interval} if s.engine == "vllm" else {}),
                "groups_submitted": len(submitted),
                "groups_replayed": sum("replay_of" in t["metadata"] for t in submitted),
                "rollouts_per_minute": round(rollouts / rl_minutes, 1) if rl_minutes > 0 else None,
                "rl_cpu_seconds": cpu,
                "rl_cpu_seconds_by_process": {name: parts for name, parts in cpu_parts.items() if len(parts) > 1},
                "cpu_ms_per_rollout": {name: round(1000 * sec / rollouts, 1) for name, sec in cpu.items()}
                if rollouts else {}}
    finally:
        Supervisor(cfg.run_dir).stop_all()
        if cfg.embedded:
            from forge_stream.deploy import local_broker

            local_broker(cfg).stop()


def prompt_sources(records: list[dict]) -> dict:
    """Where the prompt tokens of the RL phase's completions came from: computed, the engine's own prefix cache,
    the shared KV tier (summed over the completions that say; the tier's share of those prompt tokens).

    >>> prompt_sources([{"prompt_tokens_computed": 40, "prompt_tokens_engine_cache": 32, "prompt_tokens_tier": 128},
    ...                 {"prompt_tokens_computed": None}])
    {'computed': 40, 'engine_cache': 32, 'tier': 128, 'completions': 1, 'tier_share': 0.64, 'cached_share': 0.8}
    """
    known = [r for r in records if r.get("prompt_tokens_computed") is not None]
    totals = {key: sum(r[f"prompt_tokens_{key}"] for r in known) for key in ("computed", "engine_cache", "tier")}
    whole = sum(totals.values())
    return {**totals, "completions": len(known), "tier_share": round(totals["tier"] / whole, 4) if whole else None,
            "cached_share": round((whole - totals["computed"]) / whole, 4) if whole else None}


def service_restarts(cfg: ForgeSettings) -> dict[str, int]:
    """How often the supervisor restarted each service of the topology in `cfg` that it restarted at all (a vLLM
    engine whose worker died, a crashed trainer): a run with restarts measured a pipeline that stalled meanwhile."""
    return {name: entry.get("restarts", 0) for name, entry in Supervisor(cfg.run_dir).status().items()
            if entry.get("restarts")}


class NothingTrained(RuntimeError):
    """RL ran its budget without one training step: an improvement would be a second evaluation's noise."""


class EngineGone(RuntimeError):
    """The engine stopped answering after RL: the trained policy cannot be evaluated (its log says why)."""


def _cpu_by_service(cfg: ForgeSettings) -> CpuParts:
    """Each service's CPU seconds so far by part (its own process, vLLM's processes, its children: the controller's
    agents), the broker's too."""
    running = processes()
    out = {name: proc_tree_cpu(entry["pid"], running)
           for name, entry in Supervisor(cfg.run_dir).status().items() if entry.get("pid")}
    if cfg.embedded and "broker" not in out:  # `up` supervises the embedded broker as the service `broker`
        from forge_stream.deploy import local_broker

        pid = local_broker(cfg).pid()
        if pid:
            out["kafka"] = proc_tree_cpu(pid, running)
    return out
