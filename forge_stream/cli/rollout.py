"""`forge-stream rollout run`: roll out tasks with an unmodified agent through the gateway, grade, reward.

Before it publishes any task it checks that the gateway and, through it, the engine answer (one line and exit status
1 within seconds where either does not; a service started with --wait-for-kafka waits for them, saying why).
It runs until the task source ends (or, with `--loop`, until stopped): Ctrl-C or SIGTERM stops taking new
groups and lets the sessions in flight finish (a second one aborts them; the next start closes them). A run in which
every session failed, or no session ran (and no group was left to an earlier run of the same name), exits with status
1 and one line saying so; sessions that failed are reported by reason, one line per distinct reason with its count,
never one per session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from typing import Optional

import typer
from rich.progress import Progress

from forge_stream.cli.options import AdminTokenOption, BootstrapOption, JsonOption, settings, task_source
from forge_stream.cli.options import admin_token as deployment_token
from forge_stream.startup import WaitForKafkaOption, reach_gateway, ready_kafka, user_error

app = typer.Typer(no_args_is_help=True, help="The agent side: tasks -> groups of sessions -> rewards.")


@app.callback()
def group() -> None:
    """Roll out tasks with an agent."""


def make_agent(command: str, workers: int, per_worker: int, timeout_s: float):
    """`workers` > 0: a pool of long-lived processes (JSON lines); 0: one process per session. A relative path in
    `command` that names no file here but a shipped one (the tour's `examples/agents/tool_agent.py`) is that file."""
    from forge_stream.rollout.agents import CommandAgent
    from forge_stream.rollout.pool import PooledCommandAgent
    from forge_stream.shipped import command_line

    command = command_line(command)
    if workers > 0:
        return PooledCommandAgent(command, workers, per_worker, timeout_s)
    return CommandAgent(command, timeout_s)


def install_stop(stop: asyncio.Event, echo) -> None:
    """First SIGINT/SIGTERM: set `stop`; the second cancels the running task."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal() -> None:
        if stop.is_set():
            main.cancel()
            return
        echo("stopping: no new groups; waiting for the sessions in flight (again to abort)")
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)


@app.command("run")
def run(
    tasks: str = typer.Option(..., help="A JSONL file (task_id, prompt, domain, grader, group_size a line) or "
                                        "suite:<split>[?seed=..&mix=..]."),
    agent: str = typer.Option(..., help="Agent command line (OPENAI_BASE_URL, OPENAI_API_KEY, FORGE_TASK_JSON; "
                                        "with --agent-workers: the JSON-lines protocol on stdin/stdout)."),
    agent_workers: int = typer.Option(0, help="Long-lived agent processes; 0 starts one process per session."),
    agent_per_worker: int = typer.Option(16, help="Episodes in flight per agent process."),
    gateway_url: Optional[str] = typer.Option(None, help="Gateway base URL (default: the local one)."),
    name: str = typer.Option("rollout", help="Controller name: part of every group id; a restart with the same "
                                             "name skips the Tasks it already published (all but those of groups "
                                             "in which no session ran: it rolls those out again)."),
    group_size: Optional[int] = typer.Option(None, help="Override every task's group size G."),
    concurrency: int = typer.Option(8, help="Sessions in flight."),
    attempt: int = typer.Option(0, help="First cycle number: roll the same tasks out again as new groups."),
    loop: bool = typer.Option(False, "--loop", help="Start the source over (next cycle) until stopped."),
    max_groups: Optional[int] = typer.Option(None, help="Stop after this many groups."),
    replay_edge: float = typer.Option(0.0, help="Share of groups that re-run a recent task whose group's rewards "
                                                "differed (the only groups that carry a gradient); 0: off."),
    agent_timeout: float = typer.Option(600.0, help="Seconds before an episode fails (session status error)."),
    admin_token: Optional[str] = AdminTokenOption,
    report_every: float = typer.Option(30.0, help="Without a terminal (a service's log, a pipe): log the groups, "
                                                  "sessions and mean reward every this many seconds (0: never)."),
    bootstrap_servers: Optional[str] = BootstrapOption,
    wait_for_kafka: bool = WaitForKafkaOption,
    as_json: bool = JsonOption,
) -> None:
    """Submit each task (forge.tasks), run G agents per task through the gateway, grade, post rewards, finish.
    Exit status 1, with one line saying why, when every session failed or none ran."""
    from forge_stream.kafka.producer import EventProducer
    from forge_stream.rollout.controller import ProgressLog, RolloutController, RolloutSettings
    from forge_stream.rollout.sources import ResizedTasks

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if group_size is not None and group_size < 1:
        raise user_error(f"--group-size {group_size}: a group needs at least 1 session")
    source = task_source(tasks)
    cfg = settings(bootstrap_servers)
    ready_kafka(cfg, wait=wait_for_kafka)
    if group_size is not None:
        source = ResizedTasks(source, group_size)
    try:
        rollout = RolloutSettings(gateway_url or f"http://127.0.0.1:{cfg.gateway_port}", cfg.bootstrap, name,
                                  deployment_token(admin_token, cfg), concurrency, attempt, loop, max_groups,
                                  replay_edge=replay_edge)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    reach_gateway(rollout.gateway_url, rollout.admin_token, wait=wait_for_kafka)  # before any Task is published
    producer = EventProducer(cfg.bootstrap, patient=True)  # an outage pauses submissions
    reports = ProgressLog(report_every, concurrency) if report_every > 0 and not sys.stderr.isatty() else None
    if reports:
        logger = logging.getLogger("forge_stream.rollout.controller")
        logger.setLevel(logging.INFO)
        logger.info("rolling out %s with `%s` through %s: up to %d sessions in flight%s; a progress line every %g s",
                    tasks, agent, rollout.gateway_url, concurrency, ", the source over and over" if loop else "",
                    report_every)

    async def main(progress: Progress) -> dict:
        runner = make_agent(agent, agent_workers, agent_per_worker, agent_timeout)
        stop = asyncio.Event()
        install_stop(stop, lambda line: typer.echo(line, err=True))
        bar = progress.add_task("rolling out", total=max_groups)
        controller = RolloutController(rollout, runner, producer)

        def done(_task_id, outcomes) -> None:
            progress.advance(bar)
            if reports:
                reports.add(outcomes)

        reporting = reports and asyncio.create_task(
            reports.run(lambda: controller.slots.capacity - controller.slots.free))
        try:
            return await controller.run(source, stop, progress=done)
        finally:
            if reporting:
                reporting.cancel()
            if hasattr(runner, "aclose"):
                await runner.aclose()

    try:
        with Progress(transient=True) as progress:
            result = asyncio.run(main(progress))
    finally:
        producer.close()
    typer.echo(json.dumps(result) if as_json else
               f"{result['groups']} groups, {result['sessions']} sessions ({result['failed_sessions']} failed, "
               f"{result['failed_groups']} groups not submitted, {result['skipped_groups']} already submitted, "
               f"{result['recovered_sessions']} left open by an earlier run closed, {result['replayed_groups']} "
               f"replayed at the edge, {result['rerun_groups']} rolled out again (no session of an earlier run's "
               f"group of the task ran), {result['unopened_groups']} closed at once (no session opened)), "
               f"mean reward {result['mean_reward']}")
    failed = run_failure(result)
    if failed:
        typer.echo(f"error: {failed}", err=True)
        raise typer.Exit(1)
    for reason, count in list(result["failures"].items())[:SHOWN_REASONS]:
        typer.echo(f"warning: {count} session{'s' * (count > 1)} failed: {reason}", err=True)
    if len(result["failures"]) > SHOWN_REASONS:
        typer.echo(f"warning: sessions failed for {len(result['failures']) - SHOWN_REASONS} other reasons (each "
                   "session's is on forge.sessions)", err=True)


SHOWN_REASONS = 5  # distinct reasons of failed sessions printed after a run that did its work


def run_failure(result: dict) -> str | None:
    """What makes a rollout run a failure, in one line: every session failed (with the commonest reason), or none ran
    although no earlier run of this name had submitted the groups; None when it did its work."""
    sessions, failed = result["sessions"], result["failed_sessions"]
    if sessions and failed == sessions:
        reasons = list(result["failures"].items()) or [("unknown", failed)]
        reason, count = reasons[0]
        if len(reasons) == 1:
            return f"every session failed ({failed} of {sessions}): {reason}"
        return (f"every session failed ({failed} of {sessions}); {count} of them: {reason}; the others for "
                f"{len(reasons) - 1} other reasons (each session's is on forge.sessions)")
    if sessions or result["skipped_groups"]:
        return None
    if result["failed_groups"]:
        return (f"no session ran: Kafka took none of the {result['failed_groups']} tasks (see the errors above; "
                "`forge-stream status` shows the broker)")
    return "no session ran: the task source gave no task (an empty file, or --max-groups 0)"
