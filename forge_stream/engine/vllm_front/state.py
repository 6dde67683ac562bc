"""What the modules of `forge-stream engine vllm` share: its settings (and the vLLM command line they make), the
version gate its requests pass, the engine's state, and how the process ends when vLLM cannot go on.
app.py (the front), load.py, adapters.py and reference_probe.py (moving vLLM to a policy version, and proving it)
build on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import httpx

from forge_stream.credentials import ENGINE_ENV, refuse_open_bind
from forge_stream.engine.shared.follower import FollowerStatus
from forge_stream.engine.vllm_front.load_plan import VllmControl, WorkerError
from forge_stream.engine.vllm_front.runtime import VllmRuntime
from forge_stream.kvtier import cache_salt, connector_args, remove_orphaned_kv

if TYPE_CHECKING:
    from forge_stream.lora import ResidentBase

log = logging.getLogger(__name__)

# vLLM's CPU attention takes KV blocks of a multiple of 32 tokens and defaults to 128; the prefix cache reuses whole
# blocks only, so an agent's next turn recomputes up to 127 tokens of what it sent before (SmolLM2 in bench learning:
# 52% of prompt tokens cached at 128, 92% at 32)
CPU_BLOCK_SIZE = 32
VLLM_URL = "http://vllm"  # vLLM's server, over its Unix socket (the host name is not used)
PRIVATE_PREFIX = "engine-vllm-"  # + the engine's pid: the folder of vLLM's socket in the cache directory
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (Linux: 108 with the final NUL)
# adapters in one batch: the served version's, the one being proven, and two retired ones whose requests still run
# (vLLM schedules no request of a further adapter while the batch holds MAX_LORAS: with 2, a new version's probe
# waited until every request of the version before the served one had ended, seconds under load)
MAX_LORAS = 4
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32.0 takes


def vllm_lora_rank(rank: int) -> int:
    """The least --max-lora-rank vLLM takes that holds adapters of `rank`.

    >>> vllm_lora_rank(1), vllm_lora_rank(4), vllm_lora_rank(8)
    (1, 8, 8)
    """
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"vLLM serves LoRA adapters of rank {VLLM_LORA_RANKS[-1]} at most, not {rank}")


@dataclass(frozen=True)
class VllmEngineSettings:
    model: str
    runtime: VllmRuntime
    cache_dir: Path
    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: str | None = None
    policy_version: int = 0
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 64
    kv_cache_gib: int = 2
    block_size: int | None = None  # tokens per KV block, the prefix cache's granularity; None: CPU_BLOCK_SIZE on
    # CPU hosts, vLLM's own on GPUs
    tool_call_parser: str = "hermes"
    probe: bool = True
    load_interval_s: float = 0.0  # the least time from the end of one load to the start of the next
    mq_poll_s: float | None = None  # how vLLM's step queue waits (vllm_env); None: polled on CPU hosts, spun on GPUs
    start_timeout_s: float = 900.0
    extra_args: tuple[str, ...] = ()
    bootstrap: str | None = None
    policy_run: str = "default"
    token: str | None = None  # with it, every route but /health needs it as a bearer token
    lora_rank: int = 0  # > 0: LoRA on, for adapters of up to this rank (a run trained with `train --lora-rank`)
    checkpoint_dir: str | None = None  # the checkpoint store: forge.policy records load only from inside it
    kv_tier: str | None = None  # HOST:PORT of the shared KV tier's LMCache server (forge_stream.kvtier), if any

    def __post_init__(self):
        refuse_open_bind("The engine", self.host, self.token, ENGINE_ENV)

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).name  # the directory's name: never a host path

    @property
    def kv_connector(self) -> bool:
        """Whether vLLM runs with a KV connector of the caller's own (`--vllm-arg`): a reload then resets that
        connector's cache too, since its keys carry no policy version. The shared tier (`kv_tier`) needs no reset:
        its keys are salted by version (forge_stream.kvtier.cache_salt), and other engines still serve from it."""
        return any("kv-transfer-config" in a or "kv_transfer_config" in a for a in self.extra_args)

    def vllm_argv(self, socket: Path) -> list[str]:
        """vLLM's server command, listening on the Unix socket `socket` only."""
        argv = [str(self.runtime.python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--served-model-name", self.name, "--uds", str(socket),
                "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
                "--max-num-seqs", str(self.max_num_seqs), "--logprobs-mode", "processed_logprobs",
                "--enable-prefix-caching", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
                "--worker-extension-cls", "forge_worker.ForgeWorkerExtension",
                "--enable-prompt-tokens-details"]  # each answer's cached prompt tokens, recorded per completion
        block_size = self.block_size or (CPU_BLOCK_SIZE if self.runtime.target == "cpu" else None)
        if block_size:
            argv += ["--block-size", str(block_size)]
        if self.tool_call_parser:
            argv += ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_call_parser]
        if self.lora_rank:
            # priority: a new adapter's probe (reference_probe.sample_next) goes ahead of agents' waiting requests,
            # which all keep vLLM's default priority and so its first-come order
            argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(self.lora_rank)),
                     "--max-loras", str(MAX_LORAS), "--scheduling-policy", "priority"]
        if self.kv_tier:
            argv += connector_args(self.kv_tier, self.runtime.target)
        return argv + list(self.extra_args)


class VersionGate:
    """Requests pass while the gate is open, each under the version then served; `close` waits until the requests
    in flight have ended and holds new ones until `reopen(version)`."""

    def __init__(self, version: int):
        self.version = version
        self.in_flight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    async def enter(self) -> int:
        while not self._open.is_set():
            await self._open.wait()
        self.in_flight += 1
        self._idle.clear()
        return self.version

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def close(self) -> None:
        self._open.clear()
        await self._idle.wait()

    def reopen(self, version: int) -> None:
        self.version = version
        self._open.set()


@dataclass
class EngineState:
    settings: VllmEngineSettings
    gate: VersionGate
    holds: Path  # this engine's folder of held checkpoints (see hold_checkpoint)
    private: Path | None = None  # this engine's folder (mode 0700) of vLLM's socket, once made
    http: aiohttp.ClientSession | None = None
    control: VllmControl | None = None
    proc: subprocess.Popen | None = None
    checkpoint: str = ""  # the served version's checkpoint, as the trainer published it
    serving: str = ""  # the folder vLLM loaded it from: the start-up model, or a held copy
    ready: bool = False
    follower: FollowerStatus = field(default_factory=FollowerStatus)  # loads, failures; None running: not ok
    fingerprint: str | None = None  # of the served weights (weights_fingerprint), once computed
    last_mismatch: float | None = None
    mq_poll_s: list[float | None] | None = None  # each worker's, read back once at start-up
    adapters: dict[int, str] = field(default_factory=dict)  # policy version -> name of its LoRA adapter in vLLM
    adapter_users: dict[str, int] = field(default_factory=dict)  # adapter name -> requests in flight under it
    retired: dict[str, str] = field(default_factory=dict)  # adapter name -> held folder, kept for its last users
    forgetting: set[asyncio.Task] = field(default_factory=set)  # retired adapters being unloaded (release)
    resident: ResidentBase | None = None  # the base model the probe runs adapters on (LoRA: from the first version)

    vllm_url: str = VLLM_URL

    def salt_for(self, version: int, model: str) -> str:
        """The cache salt of a request that entered the gate under `version` and goes to vLLM as `model`."""
        return cache_salt(self.settings.policy_run, version, model if model != self.settings.name else None)

    def model_for(self, version: int) -> str:
        """The model name a request that entered the gate under `version` is sent to vLLM with: the version's
        adapter, counted as in use until `release`, or the base model."""
        name = self.adapters.get(version)
        if name is None:
            return self.settings.name
        self.adapter_users[name] = self.adapter_users.get(name, 0) + 1
        return name

    def release(self, name: str) -> None:
        """A request sent under `name` has ended: a retired adapter goes with its last user (`_forget`)."""
        users = self.adapter_users.get(name, 0) - 1
        if users > 0:
            self.adapter_users[name] = users
            return
        self.adapter_users.pop(name, None)
        if name in self.retired:
            task = asyncio.get_running_loop().create_task(self._forget(name, self.retired.pop(name)))
            self.forgetting.add(task)
            task.add_done_callback(self.forgetting.discard)

    async def retire(self, name: str, folder: str) -> None:
        """Adapter `name` is no longer served: it is forgotten (`_forget`) now if no request sent under it is in
        flight, else once the last one has ended. Not sooner, for two reasons. A request the front has sent under
        `name` may not have reached vLLM's server yet, and vLLM answers 404 for a name it no longer knows (seen under
        load: an agent's request failed at a version switch). And vLLM reads an adapter's folder again whenever a
        request of it is scheduled and the adapter is not among the few it holds (with one of the next versions
        being proven, it often is not), and a folder missing then kills vLLM's engine."""
        if self.adapter_users.get(name, 0) > 0:
            self.retired[name] = folder
        else:
            await self._forget(name, folder)

    async def _forget(self, name: str, folder: str) -> None:
        """Unload adapter `name` from vLLM, then remove the folder it was loaded from (never the start-up model)."""
        await self.unload_adapter(name)
        if folder != self.settings.model:
            shutil.rmtree(folder, ignore_errors=True)

    async def lora_call(self, path: str, body: dict) -> None:
        """POST one of vLLM's LoRA routes (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`: they answer text, not
        JSON); raises WorkerError unless it answers 200."""
        response = await self.control.client.post(self.vllm_url + path, json=body)
        if response.status_code != 200:
            raise WorkerError(f"POST {path}: HTTP {response.status_code} {response.text[:300]}")

    async def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` in vLLM (best effort: a name left behind stays listed in its /v1/models)."""
        try:
            await self.lora_call("/v1/unload_lora_adapter", {"lora_name": name})
        except (WorkerError, httpx.HTTPError) as exc:
            log.warning("could not unload LoRA adapter %s from vLLM (%s)", name, exc)

    @property
    def socket(self) -> Path:
        """vLLM's Unix socket: the only way to reach its server."""
        assert self.private is not None, "vLLM's folder is made when the app starts"
        return self.private / "vllm.sock"


def stop_vllm(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def exit_engine(state: EngineState, reason: str) -> None:
    """End this process now, vLLM first (its supervisor restarts it, and with it a fresh vLLM). Not a graceful
    shutdown: that would wait for the requests held at a closed gate, which may never open again."""
    log.error("%s; stopping the engine so that it starts afresh", reason)
    if state.proc is not None:
        stop_vllm(state.proc)
    remove_folders(state)
    logging.shutdown()
    os._exit(3)



def remove_folders(state: EngineState) -> None:
    """This engine's held checkpoints and vLLM's socket folder (the next engine removes them if it was killed), and
    the shared-memory KV caches of vLLM processes that are gone (remove_orphaned_kv: the tier's connector leaves
    them behind)."""
    shutil.rmtree(state.holds, ignore_errors=True)
    if state.private is not None:
        shutil.rmtree(state.private, ignore_errors=True)
    if getattr(state.settings, "kv_tier", None):  # (a test's state may have no settings)
        removed = remove_orphaned_kv()
        if removed:
            log.info("removed the shared-memory KV caches vLLM left behind: %s", ", ".join(removed))
