"""Options shared by several commands, and the one place the CLI builds its settings object."""

from __future__ import annotations

import itertools
import os
from typing import Iterable, Optional

import typer

from forge_stream.settings import KAFKA_FIELDS, ForgeSettings
from forge_stream.startup import user_error

BootstrapOption = typer.Option(None, "--bootstrap-servers", "-b", envvar="FORGE_BOOTSTRAP_SERVERS",
                               help="An external Kafka cluster; without it the embedded local broker is used.")
JsonOption = typer.Option(False, "--json", help="Print one JSON object.")


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
