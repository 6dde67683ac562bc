"""`forge-stream gateway serve`: run the ingress gateway in front of one or more engines (`--workers N`: N
processes on one port, each a replica that serves any session; forge_stream.gateway.restore). `forge-stream gateway
balance`: HAProxy in front of several gateway hosts, routing by session (forge_stream.balancer)."""

import dataclasses
import gc
import json
import logging
import os
from typing import List, Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.startup import WaitForKafkaOption, ready_kafka, user_error

_SETTINGS_ENV = "FORGE_GATEWAY_WORKER_SETTINGS"  # how `serve --workers N` hands its settings to its workers
# A gateway call allocates a few hundred containers (the engine's parsed answer: a dict per logprob), and 64 calls
# in flight keep them alive, so CPython's default first-generation threshold (700) collects every few calls and
# promotes live objects into collections of the older ones, which walk every module's objects: about 0.3 ms of a
# call's 1.8 ms of CPU (gc.callbacks with thread CPU time, 64 callers). Frozen, and at 10,000: a tenth of that.
_GC_THRESHOLD = (10_000, 10, 10)

app = typer.Typer(no_args_is_help=True, help="The OpenAI-compatible ingress gateway.")


@app.command("serve")
def serve(
    engine: List[str] = typer.Option(..., "--engine", help="Engine base URL (repeat for several engines)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    bootstrap_servers: Optional[str] = BootstrapOption,
    admin_token: Optional[str] = typer.Option(
        None, envvar="FORGE_GATEWAY_ADMIN_TOKEN",
        help="Require bearer tokens: this one on the admin routes (sessions, rewards, finish), a session's own token "
             "on its agent's calls. Needed to listen beyond loopback."),
    engine_token: Optional[str] = typer.Option(None, envvar="FORGE_ENGINE_TOKEN",
                                               help="The engines' bearer token, sent with every call to them."),
    public_url: Optional[str] = typer.Option(None, help="Base of the URLs handed to agents."),
    max_request_bytes: int = typer.Option(8 * 1024 * 1024, help="Larger request bodies get 413."),
    max_queue: int = typer.Option(32, help="In-flight requests on a group's engine before it is bypassed."),
    ack_timeout_ms: int = typer.Option(10_000, help="Kafka acknowledgement timeout (then 503)."),
    linger_ms: float = typer.Option(
        GatewaySettings.linger_ms,
        help="How long the producer gathers Completions into one Kafka request: longer means fewer requests for the "
             "broker under load (its CPU per call), and that much more latency per call at low load."),
    max_in_flight: int = typer.Option(256, help="OpenAI calls served at once (engine call until Kafka's ack)."),
    max_waiting: int = typer.Option(1024, help="Calls waiting for a slot; past it a call is shed with 429."),
    max_wait_s: float = typer.Option(30.0, help="A call that waited this long for a slot is shed with 503."),
    shed_retry_after_s: float = typer.Option(1.0, help="Retry-After of a shed call (also as retry-after-ms)."),
    max_open_sessions: int = typer.Option(100_000, help="Open sessions; past it POST /v1/sessions gets 429."),
    finished_sessions_kept: int = typer.Option(10_000, help="Finished sessions remembered (late calls: 409)."),
    keep_alive_s: float = typer.Option(
        30.0, help="Idle keep-alive connections are closed after this; longer than clients' own idle expiry (httpx, "
                   "so the OpenAI SDK: 5 s), so a client never reuses a connection the gateway is closing."),
    policy_version: int = typer.Option(0, help="Policy version for engines whose responses carry none."),
    engine_logprobs_mode: str = typer.Option(
        "processed", help="What the engines' logprobs are, recorded on each Completion: processed (of the "
                          "distribution sampled from; vLLM: --logprobs-mode processed_logprobs) or raw."),
    workers: int = typer.Option(1, min=1, help="Processes serving the port, any session on any of them: they tell "
                                               "each other what they recorded through a ledger in shared memory."),
    shared_sessions: bool = typer.Option(
        False, help="Replicas on other hosts serve one session's calls alternately: bring a held session up to "
                    "date from Kafka before each call. Without it, a session's calls should go to the host that "
                    "holds it (route by session id); any other one rebuilds it on a miss."),
    wait_for_kafka: bool = WaitForKafkaOption,
) -> None:
    """Serve the gateway (uvicorn, with uvloop and httptools when installed)."""
    import uvicorn

    from forge_stream.gateway.app import create_app
    from forge_stream.gateway.ledger import WorkerLedger
    from forge_stream.gateway.wire import CoalescingHttpToolsProtocol
    from forge_stream.gateway.workers import bind_port, run_workers

    cfg = settings(bootstrap_servers)
    try:
        gateway = GatewaySettings(
            engines=tuple(engine), bootstrap=cfg.bootstrap, host=host, port=port, public_url=public_url,
            admin_token=admin_token or None, engine_token=engine_token or None, max_request_bytes=max_request_bytes,
            max_queue=max_queue, ack_timeout_ms=ack_timeout_ms, linger_ms=linger_ms, max_in_flight=max_in_flight,
            max_waiting=max_waiting, max_wait_s=max_wait_s, shed_retry_after_s=shed_retry_after_s,
            max_open_sessions=max_open_sessions, finished_sessions_kept=finished_sessions_kept,
            default_policy_version=policy_version, engine_logprobs_mode=engine_logprobs_mode,
            shared_sessions=shared_sessions, workers=workers)
    except ValueError as exc:
        raise user_error(str(exc)) from None
    ready_kafka(cfg, wait=wait_for_kafka)
    options = dict(host=host, port=port, log_level="warning", access_log=False, timeout_keep_alive=keep_alive_s,
                   http=CoalescingHttpToolsProtocol)
    if workers == 1:
        _configure_logging()
        app = create_app(gateway)
        _settle_gc()
        uvicorn.run(app, **options)
        return
    try:
        listening = bind_port(host, port)
    except OSError as exc:
        typer.echo(f"gateway serve: cannot listen on {host}:{port}: {exc.strerror}. Is another process serving "
                   "there? Stop it or choose another --port.", err=True)
        raise typer.Exit(1)
    with WorkerLedger.hosted(workers) as ledger:  # how the workers tell each other which sessions they recorded for
        os.environ[_SETTINGS_ENV] = json.dumps(dataclasses.asdict(dataclasses.replace(gateway, worker_ledger=ledger)))
        run_workers(uvicorn.Config(f"{__name__}:worker_app", factory=True, workers=workers, **options),
                    listening)


@app.command("balance")
def balance(
    backend: List[str] = typer.Option(..., "--backend", help="A gateway host as HOST:PORT (repeat for each host)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    check_ms: int = typer.Option(1000, help="Interval of the /health checks; two failed take a host out."),
    config: Optional[str] = typer.Option(
        None, help="Where to write the rendered HAProxy config (default: load-balancer/haproxy.cfg in FORGE_HOME)."),
) -> None:
    """Run HAProxy from the shipped config (infra/haproxy/gateway.cfg) in front of gateway hosts: every call of a
    session (its path /s/<id>/..., /v1/sessions/<id>/..., or X-Forge-Session) goes to one host by a consistent hash
    of the session id; a host failing /health is taken out and its sessions move to the others."""
    from pathlib import Path

    from forge_stream import balancer
    from forge_stream.settings import ForgeSettings

    path = Path(config) if config else ForgeSettings().home / "load-balancer" / "haproxy.cfg"
    try:
        balancer.serve(list(backend), path, bind=host, port=port, check_ms=check_ms)
    except ValueError as exc:
        raise user_error(f"gateway balance: {exc}") from None


def worker_app():
    """The app of one `serve --workers N` worker process, with the settings `serve` built."""
    from forge_stream.gateway.app import create_app

    _configure_logging()
    fields = json.loads(os.environ[_SETTINGS_ENV])
    app = create_app(GatewaySettings(**{**fields, "engines": tuple(fields["engines"])}))
    _settle_gc()
    return app


def _configure_logging() -> None:
    """The gateway's own lines (and librdkafka's: forge_stream.kafka.clientlog) at INFO, dated like the other
    services'; uvicorn's stay at warning (no line per request)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _settle_gc() -> None:
    """Once the gateway's modules and app are built: leave them out of every later collection (gc.freeze: they
    live as long as the process; a full collection walked their ~90,000 objects), and collect less often."""
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLD)
