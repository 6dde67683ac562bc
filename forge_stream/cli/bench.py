"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@app.command("codec")
def codec(as_json: bool = typer.Option(False, "--json"), events: int = 200, seconds: float = 2.0) -> None:
    """Avro (Confluent framing) vs JSON on Completion events with 4,096 + 512 token ids."""
    from forge_stream.bench.codec import run

    emit(run(events=events, seconds=seconds), as_json)
