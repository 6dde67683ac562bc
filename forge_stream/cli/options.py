"""Options shared by several commands, and the one place the CLI builds its settings object."""

from __future__ import annotations

from typing import Optional

import typer

from forge_stream.settings import ForgeSettings

BootstrapOption = typer.Option(None, "--bootstrap-servers", "-b", envvar="FORGE_BOOTSTRAP_SERVERS",
                               help="An external Kafka cluster; without it the embedded local broker is used.")
JsonOption = typer.Option(False, "--json", help="Print one JSON object.")


def settings(bootstrap_servers: Optional[str] = None) -> ForgeSettings:
    overrides = {"bootstrap_servers": bootstrap_servers} if bootstrap_servers else {}
    return ForgeSettings(**overrides)
