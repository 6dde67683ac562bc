"""The `forge-stream` command line: one Typer app, one module per command group."""

import typer

from forge_stream.cli import bench, engine, model

app = typer.Typer(no_args_is_help=True, help="forge-stream: agent RL as an event stream on Kafka.")
app.add_typer(bench.app, name="bench")
app.add_typer(engine.app, name="engine")
app.add_typer(model.app, name="model")


def main() -> None:
    app()
