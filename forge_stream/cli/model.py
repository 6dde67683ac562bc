"""`forge-stream model init` writes the tiny random-weight test model (HuggingFace layout); `model import` brings
a model a user has (GGUF or HF directory, or the named SmolLM2-135M example)."""

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
    hidden_size: int = typer.Option(128, help="Width: a multiple of 64 (heads of 32, MLP twice as wide)."),
    layers: int = typer.Option(2, min=1, help="Decoder layers."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Write a tiny model with a trained byte-level BPE tokenizer and a tool-calling chat template."""
    from forge_stream.startup import user_error
    from forge_stream.tiny.model import TinyModelSpec, init_tiny_model

    try:
        spec = TinyModelSpec.sized(hidden_size, layers, arch=arch, seed=seed, vocab_size=vocab_size)
    except ValueError as e:
        raise user_error(str(e)) from None
    emit(init_tiny_model(out, spec), as_json)


@app.command("import")
def import_(
    source: str = typer.Argument(..., help="A .gguf file, an HF model directory, or a known name: smollm2-135m."),
    out: Path = typer.Option(None, help="Directory to write (default for a known name: "
                                        "~/.cache/forge-stream/models/NAME)."),
    dtype: str = typer.Option("float32", help="float32 or bfloat16."),
    chat_template: Path = typer.Option(None, help="A Jinja chat template that renders tools, for a model whose own "
                                                  "does not and is not ChatML."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Import a model you have (GGUF or HF directory) as a forge-stream model directory; nothing comes from a hub."""
    from forge_stream.startup import user_error
    from forge_stream.model_import import KNOWN, ImportFailed, fetch_known, import_model, models_dir
    from forge_stream.settings import ForgeSettings

    settings = ForgeSettings()
    try:
        if source in KNOWN and not Path(source).exists():
            path = fetch_known(KNOWN[source], settings.cache_dir, progress=_say)
            out = out or models_dir(settings.cache_dir) / source
        else:
            path = Path(source)
            if out is None:
                raise user_error("--out DIR is needed when SOURCE is a file or a directory")
        emit(import_model(path, out, dtype=dtype, chat_template=chat_template, progress=_say), as_json)
    except ImportFailed as e:
        raise user_error(str(e)) from None


def _say(line: str) -> None:
    typer.echo(line, err=True)
