"""`forge-stream plot rewards`: the reward curve of a training run, drawn from its history on Kafka."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings
from forge_stream.startup import reach_kafka, user_error

app = typer.Typer(no_args_is_help=True, help="Pictures of a run, drawn from the topics' history.")


@app.callback()
def group() -> None:
    """Plots."""


@app.command("rewards")
def rewards(
    out: Path = typer.Option(..., help="Image file to write (PNG, SVG or PDF by its suffix)."),
    run: Optional[str] = typer.Option(None, help="Training run (default: the one that trained last)."),
    title: Optional[str] = typer.Option(None, help="Title of the picture."),
    smoothing: float = typer.Option(0.6, min=0.0, max=0.99, help="Weight of the smoothed line's moving average."),
    bootstrap_servers: Optional[str] = BootstrapOption,
    as_json: bool = typer.Option(False, "--json", help="Print the plotted series as one JSON object."),
) -> None:
    """Training outcome reward per step (raw and smoothed), composite reward, and held-out evaluations with CIs."""
    from forge_stream.analytics.curves import load_curves, plot_curves

    cfg = settings(bootstrap_servers)
    reach_kafka(cfg)
    try:
        curves = load_curves(cfg.bootstrap, run, smoothing)
    except LookupError as exc:
        raise user_error(str(exc)) from None
    if not curves.train.step and not curves.evals:
        raise user_error(f"run {curves.run!r} has no TrainStep on forge.train_metrics and no EvalResult on "
                         "forge.evals: nothing to plot (--run takes the trainer's run name; without it, the run "
                         "that trained last)")
    plot_curves(curves, out, title)
    if as_json:
        typer.echo(json.dumps(curves.to_json()))
    else:
        evaluations = len({x for s in curves.evals.values() for x in s.x})  # each has a point per domain
        domains = ", ".join(d for d in sorted(curves.evals) if d != "all")
        typer.echo(f"run {curves.run}: {len(curves.train.step)} steps, {evaluations} held-out "
                   f"evaluation{'' if evaluations == 1 else 's'}{f' ({domains})' if domains else ''} -> {out}")
