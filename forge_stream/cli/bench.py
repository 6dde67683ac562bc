"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@app.command()
def scheduler(
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
    seed: int = typer.Option(0, help="Seed of the rollout durations."),
    tasks: int = typer.Option(8192, help="Tasks (groups) in the run."),
    slots: int = typer.Option(256, help="Concurrent rollout slots C."),
    buffer: int = typer.Option(-1, help="Bound on finished groups waiting beyond the slots; -1 = unbounded."),
) -> None:
    """Windowed FIFO vs strict FIFO, greedy and an AReaL-style bound, in a seeded event simulation."""
    from forge_stream.bench import scheduler as bench

    settings = bench.SimSettings(seed=seed, tasks=tasks, slots=slots, buffer=None if buffer < 0 else buffer)
    emit(bench.run(settings), as_json)
