"""`forge-stream sink parquet`: write the reward and trajectory streams to Parquet for offline analysis."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings

app = typer.Typer(no_args_is_help=True, help="Sinks: streams to files.")


@app.callback()
def group() -> None:
    """Sinks for analytics."""


@app.command("parquet")
def parquet(
    out: Path = typer.Option(..., help="Output folder (one subfolder per topic)."),
    topic: List[str] = typer.Option(["forge.rewards", "forge.trajectories"], help="Topics to sink (repeat)."),
    group_id: str = typer.Option("forge-parquet-sink", help="Consumer group (offsets commit after each file)."),
    flush_records: int = typer.Option(1000, help="Write a file every this many records per partition..."),
    flush_seconds: float = typer.Option(10.0, help="...or this often."),
    idle_exit: Optional[float] = typer.Option(None, help="Exit after this many idle seconds (batch use)."),
    bootstrap_servers: Optional[str] = BootstrapOption,
) -> None:
    """Consume TOPICs and write Parquet files named by the offsets they hold (re-runs overwrite, never duplicate)."""
    from connectors.parquet_sink import ParquetSink, ParquetSinkSettings

    sink = ParquetSink(ParquetSinkSettings(settings(bootstrap_servers).bootstrap, out, tuple(topic), group_id,
                                           flush_records, flush_seconds))
    rows = sink.run(idle_exit_seconds=idle_exit)
    typer.echo(f"wrote {rows} rows in {len(sink.files_written)} files under {out}")
