"""What a service process does as it starts, for the command line and the engine's own entry point alike
(`python -m forge_stream.engine`, which imports no command line): a user's mistake as one line and exit status 2,
Kafka reached (exit status 1 where it does not answer) and its topics checked against the catalog (exit status 3).
"""

from __future__ import annotations

import typer

from forge_stream.settings import ForgeSettings


def user_error(message: str) -> typer.Exit:
    """A user's mistake: one line on stderr saying what is wrong and what to do, exit status 2 (a traceback is
    for bugs). Raise what it returns."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(2)


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
