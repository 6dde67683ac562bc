"""`forge-stream claims gc`: delete claim-store payloads that no SampleClaim on forge.samples names any more."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, JsonOption, settings
from forge_stream.startup import ready_kafka

app = typer.Typer(no_args_is_help=True, help="The claim-check store of samples too large for one Kafka record.")


def referenced(bootstrap: str) -> set[str]:
    """The payload hashes of every SampleClaim forge.samples still holds."""
    from forge_stream.kafka.history import Slice, read_slice
    from forge_stream.topics import TOPICS

    return {e.record["sha256"] for e in read_slice(bootstrap, TOPICS.samples, Slice()) if e.schema == "SampleClaim"}


@app.command("gc")
def gc(
    store: Optional[str] = typer.Option(None, help="fsspec URL of the store (default: the processors' "
                                                   "FORGE_HOME/processors/claims)."),
    grace_hours: float = typer.Option(24.0, help="Keep unreferenced payloads younger than this (a payload is "
                                                 "stored before its claim is published)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only count what would be deleted."),
    bootstrap_servers: Optional[str] = BootstrapOption,
    as_json: bool = JsonOption,
) -> None:
    """Delete the payloads whose claims forge.samples no longer keeps (its retention is 30 days)."""
    from forge_stream.events.claims import ClaimStore

    cfg = settings(bootstrap_servers)
    ready_kafka(cfg)
    url = store or str(Path(cfg.home).resolve() / "processors" / "claims")
    names = referenced(cfg.bootstrap)
    result = ClaimStore(url).collect(names, grace_s=grace_hours * 3600, dry_run=dry_run)
    out = {"store": url, "referenced": len(names), "deleted": result.deleted, "deleted_bytes": result.deleted_bytes,
           "kept": result.kept, "dry_run": dry_run}
    typer.echo(json.dumps(out) if as_json else
               f"{'would delete' if dry_run else 'deleted'} {result.deleted} payloads ({result.deleted_bytes:,} "
               f"bytes) from {url}; kept {result.kept} ({len(names)} claims on forge.samples)")
