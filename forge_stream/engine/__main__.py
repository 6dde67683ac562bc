"""`python -m forge_stream.engine serve --model DIR --port P`: the engine process without the full CLI."""

from forge_stream.cli.engine import app

app()
