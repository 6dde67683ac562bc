"""`forge-stream schemas ...`: list the event contracts and register new schema versions."""

from __future__ import annotations

import json

import typer

from forge_stream.cli.options import JsonOption
from forge_stream.events.registry import default_registry, register

app = typer.Typer(no_args_is_help=True, help="Avro event contracts (schemas/).")


@app.command("list")
def list_schemas(as_json: bool = JsonOption) -> None:
    """Every registered schema with its id, version and file."""
    reg = default_registry()
    rows = [{"id": e.id, "name": e.name, "version": e.version, "file": e.file} for e in reg.by_id.values()]
    typer.echo(json.dumps(rows) if as_json else
               "\n".join(f"{r['id']:>3}  {r['name']} v{r['version']}  ({r['file']})" for r in rows))


@app.command("register")
def register_cmd() -> None:
    """Give new or changed .avsc files a new id in schemas/registry.json (keep old versions in history/)."""
    changes = register()
    typer.echo("\n".join(changes) if changes else "registry.json is up to date")
