"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, JsonOption, settings

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@app.command("prefix-tree")
def prefix_tree(
    as_json: bool = typer.Option(False, "--json", help="Print one compact JSON object."),
    threads: int = typer.Option(2, help="torch CPU threads per measured step."),
    quick: bool = typer.Option(False, help="Tiny model and workloads (a smoke run, not representative)."),
) -> None:
    """One training step tree-packed vs unshared on GRPO, multi-turn and long-horizon agent workloads."""
    from forge_stream.bench import prefix_tree as bench

    emit(bench.run(quick=quick, threads=threads), as_json)


@app.command("processors")
def processors(
    bootstrap_servers: Optional[str] = BootstrapOption,
    groups: int = typer.Option(200, help="How many groups to push through."),
    group_size: int = typer.Option(4, help="Rollouts per group (G)."),
    turns: int = typer.Option(3, help="Turns per rollout."),
    as_json: bool = JsonOption,
) -> None:
    """Groups per second and last-event-to-sample latency of a processors worker."""
    from forge_stream.bench.processors import run

    emit(run(settings(bootstrap_servers).bootstrap, groups=groups, group_size=group_size, turns=turns), as_json)
