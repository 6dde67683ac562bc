"""`forge-stream eval`: held-out tasks through the gateway with the agent; mean reward per domain with a 95% CI.

Publishes one EvalResult per domain and one for "all" on forge.evals (`--json` also prints every episode's task and
reward, a failed one as 0, for paired comparisons), and no Task: its sessions are marked
`purpose: eval` and never trained on. `--policy-version V` checks what is evaluated: it refuses to start when the
engine announces another version (`/v1/models`), and fails without publishing when the completions it recorded
came from another version. It evaluates whatever the engine serves; it does not load weights.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Optional

import httpx
import typer

from forge_stream.cli.options import AdminTokenOption, BootstrapOption, JsonOption, settings, task_source
from forge_stream.cli.options import admin_token as deployment_token
from forge_stream.startup import reach_kafka


def served_versions(gateway_url: str, admin_token: str | None) -> set[int]:
    """Policy versions the engines announce in /v1/models (empty if they announce none)."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    response = httpx.get(f"{gateway_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return {m["policy_version"] for m in response.json().get("data", []) if m.get("policy_version") is not None}


def eval_command(
    tasks: str = typer.Option(..., help="Held-out tasks: a JSONL file or suite:test (suite:validation while "
                                         "tuning; options ?seed=..&mix=.. pick a stream of the same split)."),
    agent: str = typer.Option(..., help="Agent command line (as for `rollout run`)."),
    agent_workers: int = typer.Option(0, help="Long-lived agent processes; 0 starts one process per episode."),
    agent_per_worker: int = typer.Option(16, help="Episodes in flight per agent process."),
    limit: Optional[int] = typer.Option(None, help="Tasks to evaluate (needed for an endless suite)."),
    samples: int = typer.Option(1, help="Episodes per task."),
    policy_version: Optional[int] = typer.Option(None, help="Refuse unless the engine serves this version."),
    run: str = typer.Option("default", help="The training run whose policy is evaluated (keys forge.evals)."),
    split: str = typer.Option("heldout", help="Split name recorded on the results."),
    eval_id: Optional[str] = typer.Option(None, help="Id of this evaluation (default: a new one)."),
    gateway_url: Optional[str] = typer.Option(None, help="Gateway base URL (default: the local one)."),
    concurrency: int = typer.Option(8, help="Episodes in flight."),
    agent_timeout: float = typer.Option(600.0, help="Seconds before an episode fails."),
    admin_token: Optional[str] = AdminTokenOption,
    bootstrap_servers: Optional[str] = BootstrapOption,
    as_json: bool = JsonOption,
) -> None:
    """Evaluate the served policy on held-out tasks; publish EvalResults on forge.evals."""
    from forge_stream.cli.rollout import make_agent
    from forge_stream.events import now_ms
    from forge_stream.kafka.producer import EventProducer
    from forge_stream.rollout.evaluate import (EvalSettings, acting, eval_records, latest_policy,
                                               recorded_completions, recorded_versions, run_eval, score)
    from forge_stream.topics import TOPICS

    source = task_source(tasks)
    cfg = settings(bootstrap_servers)
    reach_kafka(cfg)
    admin_token = deployment_token(admin_token, cfg)
    url = gateway_url or f"http://127.0.0.1:{cfg.gateway_port}"
    served = served_versions(url, admin_token) if policy_version is not None else set()
    if served and served != {policy_version}:
        typer.echo(f"The engine serves policy version {sorted(served)}, not {policy_version}: refusing to evaluate.",
                   err=True)
        raise typer.Exit(2)
    spec = EvalSettings(url, cfg.bootstrap, eval_id or uuid.uuid4().hex, run, split, agent, admin_token,
                        concurrency, samples, limit)
    started = now_ms()

    async def main():
        runner = make_agent(agent, agent_workers, agent_per_worker, agent_timeout)
        try:
            return await run_eval(spec, runner, source)
        finally:
            if hasattr(runner, "aclose"):
                await runner.aclose()

    outcomes = asyncio.run(main())
    completions = recorded_completions(cfg.bootstrap, {o.session_id for o in outcomes}, started)
    versions = recorded_versions(completions)
    acted = acting(outcomes, completions)
    if policy_version is not None and set(versions) - {policy_version}:
        typer.echo(f"Completions came from policy versions {sorted(versions)}, not only {policy_version}: "
                   "nothing published.", err=True)
        raise typer.Exit(1)
    version = min(versions) if versions else latest_policy(cfg.bootstrap, run)
    metadata = {"policy_versions": ",".join(map(str, sorted(versions))), "tasks": tasks}
    scores = score(outcomes)
    producer = EventProducer(cfg.bootstrap)
    try:
        for record in eval_records(spec, scores, version, metadata):
            producer.send_sync(TOPICS.evals, run, record)
    finally:
        producer.close()
    if as_json:
        typer.echo(json.dumps({"eval_id": spec.eval_id, "run": run, "policy_version": version,
                               "domains": [vars(s) for s in scores], "acting": acted,
                               "outcomes": [{"task_id": o.task_id, "domain": o.domain, "ok": o.ok,
                                             "reward": o.reward if o.ok and o.reward is not None else 0.0}
                                            for o in outcomes]}))
        return
    typer.echo(f"eval {spec.eval_id} of run {run!r}, policy version {version}")
    for s in scores:
        a = acted[s.domain]
        typer.echo(f"  {s.domain:<12} {s.mean:.3f}  95% CI [{s.low:.3f}, {s.high:.3f}]  "
                   f"{s.episodes} episodes, {s.failed} failed; tool calls in {a['tool_call_rate']:.0%} of sessions "
                   f"({a['valid_call_rate']:.0%} of them valid), {a['mean_turns']:.1f} turns a session")
