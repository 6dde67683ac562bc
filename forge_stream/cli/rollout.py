"""`forge-stream rollout run`: roll out tasks with an unmodified agent through the gateway, grade, reward."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Optional

import typer
from rich.progress import Progress

from forge_stream.cli.options import BootstrapOption, JsonOption, settings

app = typer.Typer(no_args_is_help=True, help="The agent side: tasks -> groups of sessions -> rewards.")


@app.callback()
def group() -> None:
    """Roll out tasks with an agent."""


@app.command("run")
def run(
    tasks: Path = typer.Option(..., help="JSONL file, one task a line: task_id, prompt, domain, grader, group_size."),
    agent: str = typer.Option(..., help="Agent command line; it gets OPENAI_BASE_URL, OPENAI_API_KEY, FORGE_TASK_JSON."),
    gateway_url: Optional[str] = typer.Option(None, help="Gateway base URL (default: the local one)."),
    group_size: Optional[int] = typer.Option(None, help="Override every task's group size G."),
    concurrency: int = typer.Option(8, help="Agents running at once."),
    attempt: int = typer.Option(0, help="Roll the same tasks out again as new groups with another number."),
    agent_timeout: float = typer.Option(600.0, help="Seconds before an agent is killed (session status error)."),
    admin_token: Optional[str] = typer.Option(None, envvar="FORGE_GATEWAY_ADMIN_TOKEN"),
    bootstrap_servers: Optional[str] = BootstrapOption,
    as_json: bool = JsonOption,
) -> None:
    """Submit each task (forge.tasks), run G agents per task through the gateway, grade, post rewards, finish."""
    from forge_stream.kafka.producer import EventProducer
    from forge_stream.rollout.agents import CommandAgent
    from forge_stream.rollout.controller import RolloutController, RolloutSettings, TaskSpec

    cfg = settings(bootstrap_servers)
    specs = [TaskSpec.from_json(json.loads(line)) for line in tasks.read_text().splitlines() if line.strip()]
    if group_size is not None:
        specs = [TaskSpec(t.task_id, t.prompt, t.domain, t.grader, group_size, t.metadata) for t in specs]
    url = gateway_url or f"http://127.0.0.1:{cfg.gateway_port}"
    producer = EventProducer(cfg.bootstrap)
    controller = RolloutController(RolloutSettings(url, cfg.bootstrap, admin_token, concurrency, attempt),
                                   CommandAgent(agent, agent_timeout), producer)
    with Progress(transient=True) as progress:
        bar = progress.add_task("rolling out", total=len(specs))
        result = asyncio.run(controller.run(specs, progress=lambda *_: progress.advance(bar)))
    producer.close()
    typer.echo(json.dumps(result) if as_json else
               f"{result['groups']} groups, {result['sessions']} sessions ({result['failed_sessions']} failed), "
               f"mean reward {result['mean_reward']}")
