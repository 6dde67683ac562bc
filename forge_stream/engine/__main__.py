"""`python -m forge_stream.engine serve|vllm --model DIR --port P`: the engine process without the command line."""

from forge_stream.engine.command import app

app()
