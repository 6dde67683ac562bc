"""`forge-stream sink parquet|tensorboard`: streams to Parquet files for offline analysis, or to TensorBoard."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings
from forge_stream.startup import reach_kafka

app = typer.Typer(no_args_is_help=True, help="Sinks: streams to files (Parquet, TensorBoard).")


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

    cfg = settings(bootstrap_servers)
    reach_kafka(cfg)
    sink = ParquetSink(ParquetSinkSettings(cfg.bootstrap, out, tuple(topic), group_id, flush_records, flush_seconds))
    rows = sink.run(idle_exit_seconds=idle_exit)
    typer.echo(f"wrote {rows} rows in {len(sink.files_written)} files under {out}")


@app.command("tensorboard")
def tensorboard(
    logdir: Path = typer.Option(..., help="TensorBoard log folder (one subfolder per run)."),
    run: Optional[str] = typer.Option(None, help="Only this training run (default: every run)."),
    from_beginning: bool = typer.Option(False, "--from-beginning",
                                        help="Ignore the position this logdir reached before; read all history."),
    follow: bool = typer.Option(False, "--follow/--no-follow", help="Keep running; otherwise stop at the end."),
    bootstrap_servers: Optional[str] = BootstrapOption,
) -> None:
    """Write training metrics, evaluations and rollout statistics as TensorBoard scalars."""
    from connectors.tensorboard_sink import TensorBoardSink, TensorBoardSinkSettings

    cfg = settings(bootstrap_servers)
    reach_kafka(cfg)
    sink = TensorBoardSink(TensorBoardSinkSettings(cfg.bootstrap, logdir, run, from_beginning, follow))
    try:
        scalars = sink.run()
    except KeyboardInterrupt:
        scalars = sink.scalars_written
    typer.echo(f"wrote {scalars} scalars under {logdir}" +
               (f" ({sink.undecodable} undecodable records skipped)" if sink.undecodable else ""))
