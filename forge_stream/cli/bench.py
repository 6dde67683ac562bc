"""`forge-stream bench ...`: benchmarks that print one JSON object (never timed asserts in tests)."""

import json

import typer

app = typer.Typer(no_args_is_help=True, help="Benchmarks; each prints one JSON object.")


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: compact JSON for scripts, indented for people."""
    typer.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@app.command("engine")
def engine(
    requests: int = typer.Option(16, help="Concurrent requests in the batched run."),
    max_tokens: int = typer.Option(64, help="Tokens per request."),
    model_dir: str = typer.Option(None, help="Model directory (default: a fresh tiny model)."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Local engine decode throughput: one request at a time vs all batched."""
    from forge_stream.bench.engine import run

    emit(run(requests=requests, max_tokens=max_tokens, model_dir=model_dir), as_json)


@app.command("gateway")
def gateway(
    requests: int = typer.Option(4000, help="Requests per phase at the highest concurrency."),
    prompt_bytes: int = typer.Option(1000, help="User message size (the scripted engine: 1 token per byte)."),
    bootstrap_servers: str = typer.Option(None, "--bootstrap-servers", help="Kafka (default: a fresh local broker)."),
    as_json: bool = typer.Option(False, "--json", help="Print compact JSON."),
) -> None:
    """Gateway overhead vs straight to a scripted engine (p50/p99 at concurrency 1 and 64), recorded/s."""
    from forge_stream.bench.gateway import run

    emit(run(requests=requests, prompt_bytes=prompt_bytes, bootstrap=bootstrap_servers), as_json)
