"""The `forge-stream` command line: one Typer app, one module per command group."""

import typer

from forge_stream.cli import bench
from forge_stream.cli import claims
from forge_stream.cli import docs
from forge_stream.cli import eval
from forge_stream.cli import gateway
from forge_stream.cli import logs
from forge_stream.cli import model
from forge_stream.cli import plot
from forge_stream.cli import processors
from forge_stream.cli import replay
from forge_stream.cli import rollout
from forge_stream.cli import schemas
from forge_stream.cli import sft
from forge_stream.cli import sink
from forge_stream.cli import tasks
from forge_stream.cli import topics
from forge_stream.cli import train
from forge_stream.cli import up
from forge_stream.engine import command as engine

app = typer.Typer(no_args_is_help=True, help="forge-stream: agent RL as an event stream on Kafka.")
app.command("up")(up.up)
app.command("down")(up.down)
app.command("status")(up.status)
app.command("logs")(logs.logs)
app.command("train")(train.train)
app.command("replay")(replay.replay)
app.command("sft")(sft.sft)
app.command("eval")(eval.eval_command)
app.add_typer(topics.app, name="topics")
app.add_typer(schemas.app, name="schemas")
app.add_typer(processors.app, name="processors")
app.add_typer(bench.app, name="bench")
app.add_typer(claims.app, name="claims")
app.add_typer(gateway.app, name="gateway")
app.add_typer(rollout.app, name="rollout")
app.add_typer(sink.app, name="sink")
app.add_typer(plot.app, name="plot")
app.add_typer(engine.app, name="engine")
app.add_typer(model.app, name="model")
app.add_typer(tasks.app, name="tasks")
app.add_typer(docs.app, name="docs")


def main() -> None:
    app()
