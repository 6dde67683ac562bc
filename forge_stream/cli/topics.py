"""`forge-stream topics ...`: the topic catalog, and creating it on a cluster."""

from __future__ import annotations

import json
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, JsonOption, settings
from forge_stream.kafka.admin import TopicMismatch, check_topics, create_topics, repair_topics
from forge_stream.topics import TOPICS

app = typer.Typer(no_args_is_help=True, help="The topic catalog.")


@app.command("create")
def create(bootstrap_servers: Optional[str] = BootstrapOption, as_json: bool = JsonOption) -> None:
    """Create every catalog topic that is missing (idempotent)."""
    result = create_topics(settings(bootstrap_servers).bootstrap)
    typer.echo(json.dumps(result) if as_json else "\n".join(f"{k}: {v}" for k, v in result.items()))


@app.command("repair")
def repair(
    recreate: bool = typer.Option(False, "--recreate",
                                  help="Also delete and recreate topics whose partition count differs (their "
                                       "records are lost; stop the services first)."),
    bootstrap_servers: Optional[str] = BootstrapOption, as_json: bool = JsonOption,
) -> None:
    """Make the cluster's topics match the catalog: create missing ones, set configs that differ."""
    bootstrap = settings(bootstrap_servers).bootstrap
    result = repair_topics(bootstrap, recreate=recreate)
    typer.echo(json.dumps(result) if as_json else
               "\n".join(f"{k}: {v}" for k, v in result.items()) or "every topic matches the catalog")
    try:
        check_topics(bootstrap)
    except TopicMismatch as exc:
        typer.echo(f"still not as the catalog says: {exc}", err=True)
        raise typer.Exit(1)


@app.command("list")
def list_topics(as_json: bool = JsonOption) -> None:
    """The catalog: name, key, value schemas, partitions, retention, producers, consumers."""
    rows = [{"name": t.name, "key": t.key, "value_schemas": list(t.value_schemas), "partitions": t.partitions,
             "retention_ms": t.retention_ms, "cleanup_policy": t.cleanup_policy,
             "producers": list(t.producers), "consumers": list(t.consumers), "doc": t.doc} for t in TOPICS.all()]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for r in rows:
        typer.echo(f"{r['name']:<20} key={r['key']:<12} {'/'.join(r['value_schemas']):<32} "
                   f"p={r['partitions']} {r['doc']}")
