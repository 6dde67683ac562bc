"""`forge-stream model init`: write the tiny random-weight test model (HuggingFace layout)."""

from pathlib import Path

import typer

from forge_stream.cli.bench import emit

app = typer.Typer(no_args_is_help=True, help="Model directories.")


@app.callback()
def group() -> None:
    """Model directories."""


@app.command()
def init(
    out: Path = typer.Option(..., help="Directory to write the model to."),
    arch: str = typer.Option("qwen2", help="qwen2 or llama."),
    seed: int = typer.Option(0, help="Seed of the weights and the tokenizer corpus."),
    vocab_size: int = typer.Option(2048, help="Upper bound of the BPE vocabulary."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Write a tiny model with a trained byte-level BPE tokenizer and a tool-calling chat template."""
    from forge_stream.engine.tiny import TinyModelSpec, init_tiny_model

    emit(init_tiny_model(out, TinyModelSpec(arch=arch, seed=seed, vocab_size=vocab_size)), as_json)
