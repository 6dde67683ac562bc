"""`forge-stream engine serve`: run the local rollout engine as its own HTTP server process."""

import logging

import typer

from forge_stream.cli.options import ready_kafka

app = typer.Typer(no_args_is_help=True, help="The local torch rollout engine (OpenAI protocol); vLLM weight sync.")


@app.callback()
def group() -> None:
    """The local torch rollout engine."""


@app.command()
def serve(
    model: str = typer.Option(..., help="HuggingFace causal-LM directory."),
    port: int = typer.Option(8100, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    served_model_name: str = typer.Option(None, help="Model name in responses (default: the path)."),
    policy_version: int = typer.Option(0, help="Policy version of the initial weights."),
    max_batch_size: int = typer.Option(32, help="Most sequences decoded together."),
    prefix_cache_tokens: int = typer.Option(65536, help="Prompt KV kept for prompts that share a prefix (0: off)."),
    max_model_len: int = typer.Option(None, help="Prompt + completion limit (default: the model's)."),
    device: str = typer.Option("cpu", help="torch device."),
    dtype: str = typer.Option("float32", help="torch dtype of the weights."),
    logprobs_mode: str = typer.Option("processed", help="processed: logprobs of the distribution sampled from "
                                                        "(after temperature, top_p); raw: the model's at T=1."),
    bootstrap_servers: str = typer.Option(None, "--bootstrap-servers", envvar="FORGE_BOOTSTRAP_SERVERS",
                                          help="Follow forge.policy on this Kafka and load each new version."),
    policy_run: str = typer.Option("default", help="Which training run's versions to follow on forge.policy."),
) -> None:
    """Serve MODEL over /v1/chat/completions, /v1/completions, /v1/models and /v1/admin/load_weights."""
    import uvicorn

    from forge_stream.engine.api import create_app
    from forge_stream.engine.serving import EngineService
    from forge_stream.engine.settings import EngineSettings

    if bootstrap_servers:
        ready_kafka(bootstrap_servers)
    settings = EngineSettings(model=model, served_model_name=served_model_name, host=host, port=port,
                              policy_version=policy_version, max_batch_size=max_batch_size,
                              max_model_len=max_model_len, dtype=dtype, device=device,
                              logprobs_mode=logprobs_mode, prefix_cache_tokens=prefix_cache_tokens)
    # its own lines (ready, each policy version loaded) dated like the other services'; uvicorn's and aiokafka's
    # (the policy follower) at warning; no progress bar for each checkpoint loaded (a log, not a terminal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()
    app = create_app(EngineService.load(settings), policy_bootstrap=bootstrap_servers, policy_run=policy_run)
    uvicorn.run(app, host=host, port=port, log_level="warning")


@app.command("vllm-sync")
def vllm_sync(
    worker: list[str] = typer.Option(..., help="Base URL of a `vllm serve` worker (repeatable), e.g. http://h:8000."),
    run: str = typer.Option("default", help="Which training run's versions to follow on forge.policy."),
    bootstrap_servers: str = typer.Option(..., "--bootstrap-servers", envvar="FORGE_BOOTSTRAP_SERVERS",
                                          help="Kafka bootstrap servers."),
    attempts: int = typer.Option(3, help="Tries per worker and version."),
    backoff_s: float = typer.Option(0.5, help="Wait before the first retry; doubles each retry."),
    initial_version: int = typer.Option(0, help="Policy version the workers serve at start."),
) -> None:
    """Push each new policy version of RUN into the vLLM workers (they must read its checkpoint directory)."""
    import asyncio

    from forge_stream.engine.vllm_sync import SyncSettings, follow_policy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ready_kafka(bootstrap_servers)
    settings = SyncSettings(workers=tuple(worker), run=run, attempts=attempts, backoff_s=backoff_s,
                            initial_version=initial_version)
    asyncio.run(follow_policy(bootstrap_servers, settings))
