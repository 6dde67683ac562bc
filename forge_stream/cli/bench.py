"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))
