"""Options shared by several commands, and the one place the CLI builds its settings object."""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Optional

import typer

from forge_stream.settings import KAFKA_FIELDS, ForgeSettings

BootstrapOption = typer.Option(None, "--bootstrap-servers", "-b", envvar="FORGE_BOOTSTRAP_SERVERS",
                               help="An external Kafka cluster; without it the embedded local broker is used.")
JsonOption = typer.Option(False, "--json", help="Print one JSON object.")


def user_error(message: str) -> typer.Exit:
    """A user's mistake: one line on stderr saying what is wrong and what to do, exit status 2 (a traceback is
    for bugs). Raise what it returns."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


def task_source(spec: str) -> Iterable:
    """The `--tasks` of a command, checked before anything starts: a missing file, an unknown split or option, or
    a line that is no task is a user error. A file is read whole once; a suite stream yields its first task."""
    from forge_stream.rollout.sources import JsonlTasks, load_task_source

    try:
        source = load_task_source(spec)
        for _ in itertools.islice(source, None if isinstance(source, JsonlTasks) else 1):
            pass
    except (OSError, ValueError) as exc:
        raise user_error(f"--tasks {spec}: {exc}") from None
    return source


KAFKA_ANSWER_S = 10.0  # how long a command run by hand gives the deployment's Kafka to answer

WaitForKafkaOption = typer.Option(
    False, "--wait-for-kafka",
    help="Wait at start however long Kafka is away (what a service that `up` supervises does); without it, a Kafka "
         f"that does not answer within {KAFKA_ANSWER_S:.0f} s ends the command with exit status 1.")


def kafka_unreachable(cfg: ForgeSettings) -> str:
    """The one line saying that the deployment's Kafka does not answer, and what to do (`status` says it too)."""
    if cfg.embedded:
        return f"Kafka at {cfg.bootstrap} is not reachable: start it with `forge-stream up`."
    return (f"Kafka at {cfg.bootstrap} is not reachable: start that cluster, or name one that runs with "
            "--bootstrap-servers.")


def reach_kafka(cfg: ForgeSettings) -> None:
    """What a command run against the deployment does first: Kafka must answer within KAFKA_ANSWER_S, else one line
    on stderr (`kafka_unreachable`) and exit status 1, instead of waiting with nothing said."""
    from forge_stream.kafka.admin import wait_for_kafka

    try:
        wait_for_kafka(cfg.bootstrap, echo=lambda _line: None, timeout=KAFKA_ANSWER_S)
    except TimeoutError:
        typer.echo(f"error: {kafka_unreachable(cfg)}", err=True)
        raise typer.Exit(1) from None


def ready_kafka(cfg: ForgeSettings, wait: bool = False) -> None:
    """What a service does before it starts: with `wait` (--wait-for-kafka, as `up` starts it) wait for Kafka however
    long it is away, without it `reach_kafka`; then refuse to run, with the fixing command, on topics unlike the
    catalog or replicated otherwise than the deployment says (exit status 3)."""
    from forge_stream.kafka.admin import TopicMismatch, ready_topics

    if not wait:
        reach_kafka(cfg)
    try:
        ready_topics(cfg.bootstrap, echo=lambda line: typer.echo(line, err=True), replication=cfg.replication)
    except TopicMismatch as exc:
        typer.echo(f"refusing to start: {exc}", err=True)
        raise typer.Exit(3)


AdminTokenOption = typer.Option(
    None, envvar="FORGE_GATEWAY_ADMIN_TOKEN",
    help="The gateway's admin token (default: the one `forge-stream up` generated into this home's credentials.json).")


def admin_token(given: Optional[str], cfg: ForgeSettings) -> Optional[str]:
    """The gateway admin token a client of the deployment sends: the one given, else the home's (`up` made it)."""
    from forge_stream import credentials

    if given:
        return given
    found = credentials.load(cfg.home)
    return found.gateway_admin_token if found else None


_KAFKA_ENV = tuple(f"FORGE_{field.upper()}" for field in KAFKA_FIELDS)


def settings(bootstrap_servers: Optional[str] = None) -> ForgeSettings:
    """The flags over FORGE_* variables over defaults; where neither a flag nor a variable names Kafka, the Kafka
    that `forge-stream up` runs this home on (ForgeSettings.as_deployed)."""
    if bootstrap_servers:
        return ForgeSettings(bootstrap_servers=bootstrap_servers)
    cfg = ForgeSettings()
    return cfg if any(os.environ.get(name) for name in _KAFKA_ENV) else cfg.as_deployed()
