"""Options shared by several commands, and the one place the CLI builds its settings object."""

from __future__ import annotations

from typing import Optional

import typer

from forge_stream.settings import ForgeSettings

BootstrapOption = typer.Option(None, "--bootstrap-servers", "-b", envvar="FORGE_BOOTSTRAP_SERVERS",
                               help="An external Kafka cluster; without it the embedded local broker is used.")
JsonOption = typer.Option(False, "--json", help="Print one JSON object.")


def ready_kafka(bootstrap: str) -> None:
    """What a service does before it starts: wait for Kafka (however long it is away), then refuse to run, with
    the fixing command, on topics unlike the catalog (exit status 3)."""
    from forge_stream.kafka.admin import TopicMismatch, ready_topics

    try:
        ready_topics(bootstrap, echo=lambda line: typer.echo(line, err=True))
    except TopicMismatch as exc:
        typer.echo(f"refusing to start: {exc}", err=True)
        raise typer.Exit(3)


def settings(bootstrap_servers: Optional[str] = None) -> ForgeSettings:
    overrides = {"bootstrap_servers": bootstrap_servers} if bootstrap_servers else {}
    return ForgeSettings(**overrides)
