"""`forge-stream topics ...`: the topic catalog, and creating it on a cluster, replicated as the deployment says."""

from __future__ import annotations

import json
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, JsonOption, settings
from forge_stream.kafka.admin import TopicMismatch, check_topics, create_topics, repair_topics
from forge_stream.settings import ForgeSettings
from forge_stream.startup import reach_kafka, user_error
from forge_stream.topics import TOPICS, Replication

app = typer.Typer(no_args_is_help=True, help="The topic catalog.")

FactorOption = typer.Option(None, "--replication-factor", min=1,
                            help="Brokers that keep each partition (default: FORGE_REPLICATION_FACTOR, else the "
                                 "deployment's, as `up` recorded it from its topology; 1 without one).")
InSyncOption = typer.Option(None, "--min-insync-replicas", min=1,
                            help="Replicas that must have a record before it is acknowledged (default: "
                                 "FORGE_MIN_INSYNC_REPLICAS, else the deployment's; 1 without one).")


def _target(bootstrap_servers: str | None, factor: int | None, in_sync: int | None) -> tuple[str, Replication]:
    """The cluster to act on and the replication its topics must have: the flags over the deployment's."""
    cfg: ForgeSettings = settings(bootstrap_servers)
    reach_kafka(cfg)
    try:
        return cfg.bootstrap, Replication(factor or cfg.replication_factor, in_sync or cfg.min_insync_replicas)
    except ValueError as exc:
        raise user_error(str(exc)) from None


@app.command("create")
def create(bootstrap_servers: Optional[str] = BootstrapOption, replication_factor: Optional[int] = FactorOption,
           min_insync_replicas: Optional[int] = InSyncOption, as_json: bool = JsonOption) -> None:
    """Create every catalog topic that is missing (idempotent)."""
    bootstrap, replication = _target(bootstrap_servers, replication_factor, min_insync_replicas)
    try:
        result = create_topics(bootstrap, replication=replication)
    except TopicMismatch as exc:
        raise user_error(str(exc)) from None
    typer.echo(json.dumps(result) if as_json else "\n".join(f"{k}: {v}" for k, v in result.items()))


@app.command("repair")
def repair(
    recreate: bool = typer.Option(False, "--recreate",
                                  help="Also delete and recreate topics whose partition count or replication "
                                       "factor differs (their records are lost; stop the services first)."),
    bootstrap_servers: Optional[str] = BootstrapOption, replication_factor: Optional[int] = FactorOption,
    min_insync_replicas: Optional[int] = InSyncOption, as_json: bool = JsonOption,
) -> None:
    """Make the cluster's topics match the catalog: create missing ones, set configs that differ."""
    bootstrap, replication = _target(bootstrap_servers, replication_factor, min_insync_replicas)
    try:
        result = repair_topics(bootstrap, recreate=recreate, replication=replication)
    except TopicMismatch as exc:
        raise user_error(str(exc)) from None
    typer.echo(json.dumps(result) if as_json else
               "\n".join(f"{k}: {v}" for k, v in result.items()) or "every topic matches the catalog")
    try:
        check_topics(bootstrap, replication=replication)
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
