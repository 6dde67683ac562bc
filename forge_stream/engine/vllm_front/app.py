"""`forge-stream engine vllm`: real vLLM as a forge-stream rollout engine.

One process per vLLM server. It starts `vllm.entrypoints.openai.api_server` from the vLLM runtime
(forge_stream.engine.vllm_front.runtime) on a private Unix socket, with dev control routes on, and serves in front of
it the engine protocol the gateway speaks to the torch engine: `/v1/chat/completions`, `/v1/completions`,
`/v1/models`, `/health`. What it adds to vLLM's answers, and why it sits in front:

- **The policy version that produced each answer.** vLLM's OpenAI responses carry no weight version, so the front
  adds `policy_version` to every response and stream chunk. The version is exact: a `VersionGate` lets requests
  through only while no update runs, and an update starts only once the requests in flight have ended.
- **Weights follow the trainer.** It follows forge.policy with the torch engine's follower
  (forge_stream.engine.shared.follower: every version of one run, the newest first), loads each newer checkpoint with
  the plan of load_plan.py and proves it twice before the gate opens under the new version: vLLM's
  weight checksums against the checkpoint's, then vLLM's prompt log-probs of a probe sequence against the
  checkpoint's own (transformers, computed before the pause). A version that cannot be proven, or whose load fails
  in any way, is not announced: the previous checkpoint is loaded back, and if that fails too the process exits so
  its supervisor starts it afresh (vLLM stopped first: it would otherwise outlive its front). The load path is
  load.py; what its modules share, state.py. /health is not ok once the follower has stopped.
- **A trainer faster than the reloads** (a load takes seconds; the trainer may publish and rotate its checkpoints
  away meanwhile): each load starts from the newest version published, and the engine first holds the checkpoint
  it loads, hard links to its files (a copy across file systems) in a folder of its own, kept while vLLM serves
  it, so that neither the reload nor a roll-back to it can find its files gone.
- **A version with the served weights is only renamed.** A trainer step whose batch had no signal changes no weight
  but still publishes a version; one whose weight files are byte for byte the served ones is announced without a
  drain or a reload (on SmolLM2 a load costs seconds of held requests; most steps of a small batch carry no signal).
- **Loads at most every `load_interval_s`** (0: every version as it comes). Each load holds new requests while
  those in flight drain; with a trainer that publishes every few seconds, spacing the loads trades a version or two
  of staleness (which CISPO's importance weight corrects) for fewer drains.
- **LoRA versions in seconds, without a drain** (`lora_rank`, a run trained with `train --lora-rank`): vLLM starts with LoRA
  enabled, each adapter version is loaded at run time under a name of its own, proven with the same probe (the
  reference computed with peft), and served without a drain: requests entering the gate after the switch go to the
  new adapter, those in flight finish on theirs (forge_stream.engine.vllm_front.adapters).
- **Any model name.** Agents name whatever model they like; requests are sent to vLLM under its served name, or the
  name of the adapter that serves the version they entered under.
- **No spinning on CPU hosts.** vLLM's engine core and worker hand each step over through a shared-memory queue
  whose waits spin (for a second after every message), so under load both spin all the time: on 2 cores, one core
  taken from the trainer. On CPU hosts forge-stream's runtime makes them poll the queue every `mq_poll_s` (0.5 ms)
  instead (vllm_ext/sitecustomize.py), and reads each worker's setting back into /health.
- **vLLM's control routes stay private**: vLLM listens on no TCP port, only on a Unix socket (`vllm.sock`, mode
  0600) in a folder of this process's own (`<cache>/engine-vllm-<pid>-*`, mode 0700), so no other user's process
  can reach `/collective_rpc`, `/pause` or a reload (vLLM's `--api-key` would guard only its `/v1` routes); every
  call of this front goes over that socket. The front exposes no control route. With a token (FORGE_ENGINE_TOKEN)
  the front needs it on every route but /health, and bound beyond loopback it refuses to start without one.
- **Weights only from the checkpoint store**: a forge.policy record whose checkpoint lies outside `checkpoint_dir`
  (symbolic links resolved) is logged and not loaded, the rule of the torch engine (forge_stream.files.in_store).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from forge_stream.credentials import RequireBearer
from forge_stream.engine.shared.follower import follow, supervise
from forge_stream.engine.vllm_front.holds import HOLDS_PREFIX
from forge_stream.engine.vllm_front.load import load_version
from forge_stream.engine.vllm_front.load_plan import VllmControl, WorkerError
from forge_stream.engine.vllm_front.runtime import vllm_env
from forge_stream.engine.vllm_front.state import (PRIVATE_PREFIX, SOCKET_PATH_MAX, EngineState, VersionGate,
                                                  VllmEngineSettings, exit_engine, remove_folders, stop_vllm)
from forge_stream.files import remove_orphaned
from forge_stream.kvtier import remove_orphaned_kv
from forge_stream.openai_error import error_body
from forge_stream.proc import start_process
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


def _error(status: int, message: str, kind: str) -> Response:
    return Response(error_body(message, kind), status_code=status, media_type="application/json")


async def _relay(request: Request, path: str) -> Response:
    state: EngineState = request.app.state.engine
    if not state.ready:
        return _error(503, "vLLM is still starting; retry shortly.", "ServiceUnavailableError")
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return _error(400, f"The body is not JSON: {exc}", "BadRequestError")
    if not isinstance(body, dict):
        return _error(400, "The body must be a JSON object.", "BadRequestError")
    version = await state.gate.enter()
    model = body["model"] = state.model_for(version)
    body["cache_salt"] = state.salt_for(version, model)  # KV of this version only, here and in the shared tier
    if state.settings.kv_tier:
        body["kv_transfer_params"] = {"cached_token_stats": True}  # the connector says what the tier gave

    def leave() -> None:
        state.release(model)
        state.gate.leave()

    try:
        upstream = await state.http.post(state.vllm_url + path, data=orjson.dumps(body),
                                         headers={"content-type": "application/json"})
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        leave()
        return _error(503, f"vLLM did not answer ({type(exc).__name__}); retry shortly.", "ServiceUnavailableError")
    except BaseException:
        leave()
        raise
    tag = b'{"policy_version":%d,' % version
    if body.get("stream") and upstream.status == 200:
        left = False

        def done() -> None:  # once, however the stream ends: to its end, cut off, or never started
            nonlocal left
            if not left:
                left = True
                upstream.release()
                leave()

        async def relay():
            try:
                async for line in upstream.content:
                    yield b"data: " + tag + line[7:] if line.startswith(b"data: {") else line
            finally:
                done()

        stream = relay()
        weakref.finalize(stream, done)  # a caller gone before the stream started: its generator never runs
        return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(done))
    try:
        content = await upstream.read()
    finally:
        upstream.release()
        leave()
    if upstream.status == 200 and content.startswith(b"{"):
        content = tag + prompt_cache(content, bool(state.settings.kv_tier)) + content[1:]
    return Response(content, status_code=upstream.status, media_type="application/json")


def prompt_cache(content: bytes, tiered: bool) -> bytes:
    """`"prompt_cache":{...},` for an answer of vLLM's: of its prompt tokens, how many vLLM found in its own prefix
    cache (`engine`) and how many the shared tier gave (`tier`: 0 without a tier); null where vLLM did not say.
    Empty when the answer has no usage.

    >>> prompt_cache(b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":6}}}', False)
    b'"prompt_cache":{"prompt_tokens":9,"engine":6,"tier":0},'
    >>> prompt_cache(b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":6}},'
    ...              b'"kv_transfer_params":{"cached_token_stats":{"num_vllm_cached_tokens":2,'
    ...              b'"num_lmcache_extra_cached_tokens":4}}}', True)
    b'"prompt_cache":{"prompt_tokens":9,"engine":2,"tier":4},'
    """
    data = orjson.loads(content)
    usage = data.get("usage") or {}
    if not usage.get("prompt_tokens"):
        return b""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    stats = (data.get("kv_transfer_params") or {}).get("cached_token_stats")
    if not tiered:
        engine, tier = cached, 0
    elif stats:
        engine, tier = stats.get("num_vllm_cached_tokens"), stats.get("num_lmcache_extra_cached_tokens")
    else:
        engine, tier = None, None
    return b'"prompt_cache":' + orjson.dumps({"prompt_tokens": usage["prompt_tokens"], "engine": engine,
                                              "tier": tier}) + b","


def create_app(settings: VllmEngineSettings) -> FastAPI:
    """The engine app; its lifespan starts vLLM, then (with a bootstrap) follows forge.policy."""
    state = EngineState(settings, VersionGate(settings.policy_version), holds=Path(),
                        checkpoint=settings.model, serving=settings.model)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings.cache_dir.mkdir(parents=True, exist_ok=True)
        for prefix in (HOLDS_PREFIX, PRIVATE_PREFIX):
            remove_orphaned(settings.cache_dir, prefix)
        if settings.kv_tier:
            remove_orphaned_kv()  # of engines before this one, killed before they could
        state.holds = Path(tempfile.mkdtemp(prefix=f"{HOLDS_PREFIX}{os.getpid()}-", dir=settings.cache_dir))
        state.private = Path(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=settings.cache_dir))
        os.chmod(state.private, 0o700)  # mkdtemp's mode already; said here, as it is what keeps vLLM private
        if len(os.fsencode(state.socket)) > SOCKET_PATH_MAX:
            raise RuntimeError(f"vLLM's socket path {state.socket} is longer than a Unix socket's {SOCKET_PATH_MAX} "
                               "bytes: set FORGE_CACHE_DIR to a shorter folder")
        proc = state.proc = _start_vllm(settings, state.socket)
        # vLLM's server closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE): drop ours sooner, or a
        # request sent on one it is closing fails (aiohttp keeps them 15 s by default)
        state.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                           connector=aiohttp.UnixConnector(str(state.socket), limit=1024,
                                                                           keepalive_timeout=2.0),
                                           read_bufsize=1 << 24)
        tasks = [asyncio.create_task(_bring_up(state, proc))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await state.http.close()
            stop_vllm(proc)
            remove_folders(state)

    app = FastAPI(title="forge-stream vLLM engine", lifespan=lifespan)
    app.state.engine = state

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _relay(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _relay(request, "/v1/completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.name, "object": "model", "owned_by": "forge-stream",
                                            "max_model_len": settings.max_model_len,  # no root: no host path
                                            "policy_version": state.gate.version}]}

    @app.get("/health")
    async def health():
        if not state.ready:
            return JSONResponse({"status": "starting", "model": settings.name}, status_code=503)
        if state.follower.stopped:  # serving, but following the trainer no longer: unhealthy until restarted
            return JSONResponse({"status": "not following", "model": settings.name, "reason": state.follower.stopped,
                                 "policy_version": state.gate.version}, status_code=503)
        return {"status": "ok", "model": settings.name, "policy_version": state.gate.version,
                "checkpoint": state.checkpoint, "engine": "vllm", "in_flight": state.gate.in_flight,
                **state.follower.health(), "probe_mismatch": state.last_mismatch, "mq_poll_s": state.mq_poll_s,
                "lora_adapter": state.adapters.get(state.gate.version), "kv_tier": settings.kv_tier}

    if settings.token:
        app.add_middleware(RequireBearer, token=settings.token)
    return app


def _start_vllm(settings: VllmEngineSettings, socket: Path) -> subprocess.Popen:
    argv = settings.vllm_argv(socket)
    log.info("starting vLLM (%s) on unix socket %s: %s", settings.runtime.path, socket, " ".join(argv[3:]))
    return start_process(argv, new_session=True, preexec_fn=_end_with_parent,
                         env=vllm_env(settings.cache_dir, settings.runtime.target, settings.kv_cache_gib,
                                      settings.mq_poll_s, lora=settings.lora_rank > 0))


def _end_with_parent() -> None:
    """In the vLLM child before exec: SIGTERM it when this process dies, however it dies (Linux), so that a killed
    front leaves no vLLM server behind (it runs in a session of its own, out of reach of signals to our group)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _bring_up(state: EngineState, proc: subprocess.Popen) -> None:
    settings = state.settings
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=600, transport=httpx.AsyncHTTPTransport(uds=str(state.socket))) as client:
        while True:
            if proc.poll() is not None:
                return exit_engine(state, f"vLLM exited during start-up (exit code {proc.returncode})")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(state.vllm_url + "/health", timeout=5)).status_code == 200:
                    break
            if time.monotonic() - started > settings.start_timeout_s:
                return exit_engine(state, f"vLLM was not healthy within {settings.start_timeout_s:.0f}s")
            await asyncio.sleep(1.0)
        os.chmod(state.socket, 0o600)  # vLLM binds it under its umask; the folder's 0700 kept it private until now
        state.control = VllmControl(state.vllm_url, client, settings.dtype, reset_external=settings.kv_connector)
        with contextlib.suppress(WorkerError, httpx.HTTPError):  # reported on /health; serving goes on without it
            state.mq_poll_s = await state.control.mq_poll()
        state.ready = True
        log.info("engine ready (pid %d) on %s:%d: vLLM %s (started in %.0fs) serving %s at policy version %d%s; %s",
                 os.getpid(), settings.host, settings.port, settings.runtime.target, time.monotonic() - started,
                 settings.model, state.gate.version,
                 f", prompt KV shared through the tier at {settings.kv_tier}" if settings.kv_tier else "",
                 f"loads each new version of run {settings.policy_run!r} from {TOPICS.policy.name} at "
                 f"{settings.bootstrap}" if settings.bootstrap else "follows no policy topic")
        follower = None
        if settings.bootstrap:
            def served() -> tuple[int, str]:
                return state.gate.version, state.checkpoint

            follower = supervise(follow(settings.bootstrap, settings.policy_run, served,
                                        functools.partial(load_version, state), state.follower,
                                        settings.load_interval_s), state.follower)
        try:
            await _watch_process(state, proc)
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower


async def _watch_process(state: EngineState, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        await asyncio.sleep(1.0)
    exit_engine(state, f"vLLM exited (exit code {proc.returncode})")
