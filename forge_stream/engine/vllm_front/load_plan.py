"""Move one running vLLM server (0.32.0, VLLM_SERVER_DEV_MODE=1) to a new policy version, and prove it took.

The plan, measured against the real server (`tests/vllm/test_weight_sync.py`):

    GET  /is_sleeping                    -> {"is_sleeping": false}: reloading a sleeping engine crashes it (vllm #57853)
    POST /pause?mode=wait                requests in flight finish on the old weights; new ones wait in vLLM's queue
    POST /collective_rpc {"method": "forge_reload_weights", "kwargs": {"weights_path": DIR}}
                                         every worker reloads in place from DIR (an HF directory, same architecture):
                                         vLLM's `reload_weights`, then on CPUs the tied LM head's packed weights
                                         packed again (forge_stream/engine/vllm_front/vllm_ext/forge_worker.py)
    POST /weight_checker {"action": "checksum"}
                                         the proof: sha256 of every parameter as the workers now hold it
    POST /update_weight_version {"new_version": "V"}      only once the proof holds: `GET /weight_info` says V
    POST /reset_prefix_cache[?reset_external=true]        no KV computed by the old weights is reused (and LMCache's)
    POST /resume

What does not work on the real server (and the plan therefore avoids): `collective_rpc update_config` with
{"model_config": {"model": DIR}} answers 500 (`Field '_hf_config_revision' not found in ModelConfig`), and a bare
`reload_weights` reloads the weights the server started with; `update_weight_version` succeeds either way, which
is why a version is set only after the proof.

The proof compares vLLM's checksums with the checkpoint's: sha256 over the bytes of each tensor, cast to the
served dtype, for every parameter with the same name in both (vLLM fuses q/k/v and gate/up into one parameter
each, and on CPUs repacks linear weights into its kernels' layout, reported as an empty tensor; embeddings, norms
and biases keep the checkpoint's names and bytes). At least one must match and none may differ; the fused ones
that can be read must have changed since the previous version if the others did. forge_stream.engine.vllm_front.app
adds a second proof once vLLM serves again behind its closed gate: prompt log-probs of a probe sequence.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One HTTP request of an update plan; `expect` is the JSON body the step requires, if any."""

    method: str
    path: str
    params: dict = field(default_factory=dict)
    body: dict | None = None
    expect: dict | None = None


class WorkerError(RuntimeError):
    """A step of the plan failed on the vLLM server, or its proof did not hold."""


def load_plan(checkpoint_dir: str) -> list[Call]:
    """The calls that load `checkpoint_dir` into a server that serves nothing meanwhile."""
    return [
        Call("GET", "/is_sleeping", expect={"is_sleeping": False}),
        Call("POST", "/pause", params={"mode": "wait"}),
        Call("POST", "/collective_rpc", body={"method": "forge_reload_weights", "kwargs": {"weights_path": checkpoint_dir}}),
    ]


def announce_plan(version: int, reset_external: bool = False) -> list[Call]:
    """The calls that, once the new weights are proven, name their version, drop stale KV and serve again."""
    return [
        Call("POST", "/update_weight_version", body={"new_version": str(version)}),
        Call("POST", "/reset_prefix_cache", params={"reset_external": "true"} if reset_external else {}),
        Call("POST", "/resume"),
    ]


EMPTY = hashlib.sha256(b"").hexdigest()  # what vLLM reports for a weight repacked into a kernel's own layout


def comparable(checksums: dict[str, str]) -> dict[str, str]:
    """vLLM's checksums ("dp0:pp0:pcp0:tp0:NAME": digest) by parameter name, keeping those every rank holds whole
    (the same digest on all ranks) and not repacked (an empty tensor's digest)."""
    by_name: dict[str, set[str]] = {}
    for key, digest in checksums.items():
        by_name.setdefault(key.rsplit(":", 1)[-1], set()).add(digest)
    return {name: next(iter(d)) for name, d in by_name.items() if len(d) == 1 and EMPTY not in d}


VOCAB_PADDING = 64  # vLLM pads embedding and LM-head rows to a multiple of this, with zeros


def _sha256(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def checkpoint_digests(checkpoint_dir: str | Path, names: set[str], dtype: str) -> dict[str, tuple[str, ...]]:
    """For each tensor named in `names` in the checkpoint's safetensors files, cast to `dtype`: the sha256 vLLM
    reports when it holds that tensor as it is, or (a vocabulary-sized one) padded with zero rows."""
    import torch
    from safetensors import safe_open

    torch_dtype = getattr(torch, dtype)
    out = {}
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise WorkerError(f"{checkpoint_dir} holds no *.safetensors file to check the served weights against")
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key not in names:
                    continue
                tensor = f.get_tensor(key).to(torch_dtype)
                digests = [_sha256(tensor)]
                rows = -(-tensor.shape[0] // VOCAB_PADDING) * VOCAB_PADDING if tensor.dim() else 0
                if tensor.dim() == 2 and rows != tensor.shape[0]:
                    digests.append(_sha256(torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0],
                                                                               tensor.shape[1])])))
                out[key] = tuple(digests)
    return out


@dataclass(frozen=True)
class Proof:
    """What the checksum comparison found: parameters equal to the checkpoint's, and those vLLM holds fused."""

    matched: int
    fused_changed: int
    fused: int


def prove(served: dict[str, str], expected: dict[str, tuple[str, ...]], previous: dict[str, str] | None) -> Proof:
    """Check the served checksums against the checkpoint's (see the module docstring); raise WorkerError if they
    do not prove the checkpoint is what the server holds."""
    shared = expected.keys() & served.keys()
    differ = sorted(k for k in shared if served[k] not in expected[k])
    if differ:
        raise WorkerError(f"the server's weights differ from the checkpoint's in {len(differ)} of {len(shared)} "
                          f"parameters (first: {differ[0]}): the reload did not load it")
    if not shared:
        raise WorkerError("no parameter of the server has the checkpoint's name: cannot prove the reload")
    fused = sorted(served.keys() - expected.keys())
    changed = sum(previous is not None and previous.get(k) != served[k] for k in fused)
    if previous is not None and fused and not changed and any(previous.get(k) != served[k] for k in shared):
        raise WorkerError(f"none of the {len(fused)} fused parameters changed while the others did: the reload "
                          "was partial")
    return Proof(len(shared), changed, len(fused))


class VllmControl:
    """Drives one vLLM server's control routes over HTTP (its base URL, without /v1)."""

    def __init__(self, url: str, client: httpx.AsyncClient, dtype: str = "float32", reset_external: bool = False):
        self.url = url.rstrip("/")
        self.client = client
        self.dtype = dtype
        self.reset_external = reset_external
        self.served: dict[str, str] | None = None  # checksums after the last proven load

    async def call(self, step: Call):
        response = await self.client.request(step.method, self.url + step.path, params=step.params or None,
                                             json=step.body)
        if response.status_code != 200:
            raise WorkerError(f"{step.method} {step.path}: HTTP {response.status_code} {response.text[:300]}")
        got = response.json()
        if step.expect is not None and any(got.get(k) != v for k, v in step.expect.items()):
            raise WorkerError(f"{step.method} {step.path}: expected {step.expect}, got {got}")
        return got

    async def checksums(self) -> dict[str, str]:
        """The served weights' checksums that can be compared with a checkpoint's (see `comparable`)."""
        return comparable((await self.call(Call("POST", "/weight_checker", body={"action": "checksum"})))["checksums"])

    async def load(self, checkpoint_dir: str, version: int) -> Proof:
        """Pause, reload from `checkpoint_dir`, prove it, announce `version`, resume. On any failure the server
        is resumed (best effort) still announcing its previous version, and the failure is raised (WorkerError:
        a step or the proof)."""
        if self.served is None:
            self.served = await self.checksums()
        paused = False
        try:
            for step in load_plan(checkpoint_dir):
                await self.call(step)
                paused = paused or step.path == "/pause"
            served = await self.checksums()
            expected = checkpoint_digests(checkpoint_dir, set(served), self.dtype)
            proof = prove(served, expected, self.served)
            for step in announce_plan(version, self.reset_external):
                await self.call(step)
            paused = False
        except Exception:  # whatever failed (vLLM, reading the checkpoint, parsing an answer): vLLM serves again
            if paused:
                await self.resume()
            raise
        self.served = served
        return proof

    async def resume(self, tries: int = 3) -> bool:
        """Resume a paused server after a failed step (best effort); True once it says it is not paused.

        A failed collective_rpc ends in an exception in vLLM's ASGI app, and uvicorn then drops the connection:
        the next request sent on it fails with a bare ReadError, so each try goes on a fresh connection."""
        for attempt in range(1, tries + 1):
            try:
                await self.call(Call("POST", "/resume"))
                if not (await self.call(Call("GET", "/is_sleeping")))["is_sleeping"]:
                    return True
                problem = "still paused"
            except (WorkerError, httpx.HTTPError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            log.warning("%s: resume after a failed update, try %d of %d: %s", self.url, attempt, tries, problem)
        return False

    async def mq_poll(self) -> list[float | None]:
        """How often each worker polls its step queue as forge-stream set it (None: it spins, as vLLM has it)."""
        results = (await self.call(Call("POST", "/collective_rpc", body={"method": "forge_mq_poll"})))["results"]
        return [result["poll_s"] for result in results]
