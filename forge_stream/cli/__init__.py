"""The `forge-stream` command line: one Typer app, one module per command group."""

import typer

from forge_stream.cli import (bench, engine, eval, gateway, model, processors, replay, rollout, schemas, sink,
                              topics, train, up)

app = typer.Typer(no_args_is_help=True, help="forge-stream: agent RL as an event stream on Kafka.")
app.command("up")(up.up)
app.command("down")(up.down)
app.command("status")(up.status)
app.command("train")(train.train)
app.command("replay")(replay.replay)
app.command("eval")(eval.eval_command)
app.add_typer(topics.app, name="topics")
app.add_typer(schemas.app, name="schemas")
app.add_typer(processors.app, name="processors")
app.add_typer(bench.app, name="bench")
app.add_typer(gateway.app, name="gateway")
app.add_typer(rollout.app, name="rollout")
app.add_typer(sink.app, name="sink")
app.add_typer(engine.app, name="engine")
app.add_typer(model.app, name="model")


def main() -> None:
    app()
