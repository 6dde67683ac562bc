"""`forge-stream bench learning`: the proof that the whole pipeline learns.

On a fresh home it builds the tiny model, warm-starts it on the scripted teacher's demonstrations (`sft`), starts
the local topology (its own Kafka broker unless given one, the engine on the warm model, the gateway, the
processors and the trainer), evaluates the held-out tasks through the gateway with the black-box example agent
(`forge-stream eval`), trains by RL for a fixed wall-clock budget while the rollout controller drives the same
agent over the training tasks, stops the rollouts, lets the engine load the last policy, evaluates again and
prints one JSON object. Every step is the command a user would run; the evaluations are EvalResults on
forge.evals and the steps TrainSteps on forge.train_metrics, so the curve is data (`--plot` draws it with the
code of `forge-stream plot rewards`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx

from forge_stream.deploy import Topology, up
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.services import Supervisor
from forge_stream.settings import ForgeSettings
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]
AGENT = f"{sys.executable} {REPO / 'examples' / 'agents' / 'tool_agent.py'} --serve"
RUN = "bench-learning"


SUBGOAL_RULE = "forge_stream.processors.rules.tool_result_answers"


@dataclass(frozen=True)
class LearningSettings:
    rl_minutes: float = 15.0
    engine: str = "torch"  # "vllm": real vLLM (`engine vllm`), "torch": the local torch engine
    loss: str = "cispo"
    lr: float = 1e-4
    updates_per_batch: int = 4  # optimizer updates per batch (sample reuse; the trainer is otherwise mostly idle)
    subgoal_reward: float = 0.0  # weight of the tool_result_answers process rule (0: off)
    advantage_scale: str = "none"  # "std" (GRPO) or "none" (Dr. GRPO): see forge_stream/processors/rewards.py
    batch_size: int = 16  # groups per optimizer step
    group_size: int = 8  # G rollouts per task
    concurrency: int = 64  # sessions in flight
    agent_workers: int = 2
    heldout_tasks: int = 200
    mix: str = "reasoning=1,agent=1,lookup=1"
    seed: int = 0
    sft_steps: int = 600
    sft_examples: int = 600
    sft_lr: float = 3e-3
    bootstrap: str | None = None  # an external cluster; default: the bench's own broker
    home: Path | None = None  # default: a fresh temporary directory, removed afterwards
    plot: Path | None = None  # draw the reward curve here before tearing down


def _cli(*args: str, env: dict[str, str]) -> dict:
    """Run a forge-stream command that prints one JSON object; its progress goes to our stderr."""
    done = subprocess.run([sys.executable, "-m", "forge_stream", *args, "--json"], env=env, stdout=subprocess.PIPE,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"forge-stream {' '.join(args[:2])} failed with exit code {done.returncode}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def _train_steps(bootstrap: str) -> list[dict]:
    steps = {e.record["event_id"]: e.record for e in read_slice(bootstrap, TOPICS.train_metrics, Slice())
             if e.key == RUN}
    return sorted(steps.values(), key=lambda r: r["step"])


def _latest_policy(bootstrap: str) -> int:
    return max((e.record["version"] for e in read_slice(bootstrap, TOPICS.policy, Slice()) if e.key == RUN),
               default=0)


def _served_version(engine_url: str) -> int | None:
    models = httpx.get(f"{engine_url}/v1/models", timeout=10).json().get("data", [])
    versions = [m.get("policy_version") for m in models if m.get("policy_version") is not None]
    return max(versions) if versions else None


def _wait_served(engine_url: str, version: int, timeout_s: float = 120.0) -> int | None:
    deadline = time.monotonic() + timeout_s
    served = _served_version(engine_url)
    while (served is None or served < version) and time.monotonic() < deadline:
        time.sleep(1.0)
        served = _served_version(engine_url)
    return served


def run(s: LearningSettings, progress: Callable[[str], None] = print) -> dict:
    home = s.home or Path(tempfile.mkdtemp(prefix="forge-bench-learning-"))
    ports = {name: free_port() for name in ("kafka_port", "kafka_controller_port", "registry_port", "engine_port",
                                             "gateway_port")}
    cfg = ForgeSettings(home=home, bootstrap_servers=s.bootstrap, **ports)
    env = {**os.environ, "FORGE_HOME": str(home), **{f"FORGE_{k.upper()}": str(v) for k, v in ports.items()}}
    if s.bootstrap:
        env["FORGE_BOOTSTRAP_SERVERS"] = s.bootstrap
    suite = f"seed={s.seed}&mix={s.mix}"
    gateway_url = f"http://127.0.0.1:{cfg.gateway_port}"
    engine_url = f"http://127.0.0.1:{cfg.engine_port}"
    started = time.monotonic()
    try:
        progress(f"[1/6] tiny model and warm start ({s.sft_steps} SFT steps on {s.sft_examples} demonstrations)")
        _cli("model", "init", "--out", str(cfg.model_dir), env=env)
        warm = home / "warm"
        sft = _cli("sft", "--model", str(cfg.model_dir), "--out", str(warm), "--steps", str(s.sft_steps),
                   "--examples", str(s.sft_examples), "--lr", str(s.sft_lr), "--seed", str(s.seed), "--mix", s.mix,
                   env=env)
        progress(f"[2/6] starting the topology in {home}")
        topology = Topology("bench-learning", ["engine", "gateway", "processors", "trainer"], {
            "engine": {"kind": s.engine, "model": str(warm), "max_batch_size": s.concurrency, "policy_run": RUN,
                       **({"threads": 1} if s.engine == "torch" else {})},
            "gateway": {},
            "processors": {"group_timeout_s": 120, "advantage": "rollout", "advantage_scale": s.advantage_scale,
                           "rules": [f"{SUBGOAL_RULE}={s.subgoal_reward}"] if s.subgoal_reward else []},
            "trainer": {"model": str(warm), "run": RUN, "batch_size": s.batch_size, "lr": s.lr, "loss": s.loss,
                        "updates_per_batch": s.updates_per_batch,
                        "window": 0.3, "rollout_slots": s.concurrency // s.group_size, "wait_s": 5,
                        "group_timeout": 300, "threads": 1},
        })
        up(cfg, topology, echo=progress)
        evaluate = ("eval", "--tasks", "suite:test", "--limit", str(s.heldout_tasks), "--agent", AGENT,
                    "--agent-workers", str(s.agent_workers), "--concurrency", str(s.concurrency), "--run", RUN,
                    "--gateway-url", gateway_url, "--bootstrap-servers", cfg.bootstrap)
        progress(f"[3/6] held-out evaluation of the warm start ({s.heldout_tasks} tasks)")
        baseline = _cli(*evaluate, env=env)
        progress(f"  held-out reward {_describe(baseline)}")
        progress(f"[4/6] RL for {s.rl_minutes:g} minutes ({s.loss}, lr {s.lr:g}, {s.batch_size} groups x "
                 f"G={s.group_size} a step)")
        supervisor = Supervisor(cfg.run_dir)
        cpu_before = _cpu_by_service(cfg)
        rl_started = time.monotonic()
        from forge_stream.deploy import controller_service

        supervisor.start(controller_service(cfg, {
            "tasks": f"suite:train?{suite}", "agent": AGENT, "agent_workers": s.agent_workers,
            "agent_per_worker": -(-s.concurrency // s.agent_workers), "concurrency": s.concurrency,
            "group_size": s.group_size, "name": RUN, "loop": True}))
        deadline = rl_started + s.rl_minutes * 60
        shown = 0
        while time.monotonic() < deadline:
            time.sleep(min(30.0, max(0.0, deadline - time.monotonic())))
            steps = _train_steps(cfg.bootstrap)
            for step in steps[shown:]:
                progress(f"  step {step['step']}: outcome reward {step['outcome_reward']:.3f}, "
                         f"loss {step['loss']:.4f}, mismatch {step['mismatch_mean']:.4f}, groups {step['groups']}")
            shown = len(steps)
        cpu_after = _cpu_by_service(cfg)
        cpu = {name: round(seconds - cpu_before.get(name, 0.0), 1) for name, seconds in cpu_after.items()}
        progress(f"  CPU seconds used during RL, by service: {cpu}")
        progress("[5/6] stopping the rollouts and the trainer; the engine loads the last policy")
        supervisor.stop("controller", timeout=120)
        rl_minutes = (time.monotonic() - rl_started) / 60
        supervisor.stop("trainer", timeout=120)
        last = _latest_policy(cfg.bootstrap)
        served = _wait_served(engine_url, last)
        progress(f"[6/6] held-out evaluation of policy v{served}")
        final = _cli(*evaluate, "--policy-version", str(served), env=env)
        progress(f"  held-out reward {_describe(final)}")
        steps = _train_steps(cfg.bootstrap)
        if s.plot:
            from forge_stream.analytics.curves import load_curves, plot_curves

            plot_curves(load_curves(cfg.bootstrap, RUN), s.plot,
                        f"forge-stream bench learning ({s.loss}, {rl_minutes:.1f} min RL on 2 CPU cores)")
        summary = _summary(s, sft, baseline, final, steps, rl_minutes, served, time.monotonic() - started)
        rollouts = summary["rollouts_trained"]
        return {**summary, "engine": s.engine, "rollouts_per_minute": round(rollouts / rl_minutes, 1),
                "rl_cpu_seconds": cpu,
                "cpu_ms_per_rollout": {name: round(1000 * sec / rollouts, 1) for name, sec in cpu.items()}
                if rollouts else {}}
    finally:
        Supervisor(cfg.run_dir).stop_all()
        if cfg.embedded:
            from forge_stream.deploy import local_broker

            local_broker(cfg).stop()
        if s.home is None:
            shutil.rmtree(home, ignore_errors=True)


def _proc_tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of a live process and its live descendants, from /proc (Linux)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [child for child, (parent, _) in stats.items() if parent == pid]
    return total


def _cpu_by_service(cfg: ForgeSettings) -> dict[str, float]:
    """Each service's CPU seconds so far (with its child processes: the controller's agents), and the broker's."""
    out = {name: round(_proc_tree_cpu_s(entry["pid"]), 1)
           for name, entry in Supervisor(cfg.run_dir).status().items() if entry.get("pid")}
    if cfg.embedded:
        from forge_stream.deploy import local_broker

        pid = local_broker(cfg).pid()
        if pid:
            out["kafka"] = round(_proc_tree_cpu_s(pid), 1)
    return out


def _describe(result: dict) -> str:
    by = {d["domain"]: d for d in result["domains"]}
    overall = by.pop("all")
    return (f"{overall['mean']:.3f} [{overall['low']:.3f}, {overall['high']:.3f}] ("
            + ", ".join(f"{name} {d['mean']:.2f}" for name, d in sorted(by.items())) + ")")


def _overall(result: dict) -> dict:
    return next(d for d in result["domains"] if d["domain"] == "all")


def _summary(s: LearningSettings, sft: dict, baseline: dict, final: dict, steps: list[dict], rl_minutes: float,
             served: int | None, seconds: float) -> dict:
    base, end = _overall(baseline), _overall(final)
    tokens = sum(st["total_tokens"] for st in steps)
    return {
        "baseline_reward": base["mean"], "final_reward": end["mean"],
        "improvement": end["mean"] - base["mean"],
        "baseline_ci": [base["low"], base["high"]], "final_ci": [end["low"], end["high"]],
        "baseline_by_domain": {d["domain"]: d["mean"] for d in baseline["domains"] if d["domain"] != "all"},
        "final_by_domain": {d["domain"]: d["mean"] for d in final["domains"] if d["domain"] != "all"},
        "rl_minutes": round(rl_minutes, 2), "steps": len(steps), "groups_trained": sum(st["groups"] for st in steps),
        "rollouts_trained": sum(st["rollouts"] for st in steps), "final_policy_version": served,
        "heldout_tasks": base["episodes"], "loss": s.loss,
        "mismatch_mean": sum(st["mismatch_mean"] for st in steps) / len(steps) if steps else None,
        "mismatch_max": max((st["mismatch_max"] for st in steps), default=None),
        "clip_fraction_mean": sum(st["clip_fraction"] for st in steps) / len(steps) if steps else None,
        "train_outcome_reward_first": steps[0]["outcome_reward"] if steps else None,
        "train_outcome_reward_last": steps[-1]["outcome_reward"] if steps else None,
        "trained_tokens": tokens, "sft": {k: sft[k] for k in ("steps", "examples", "final_loss", "seconds")},
        "seconds_total": round(seconds, 1), "settings": {k: str(v) for k, v in asdict(s).items()},
    }
