"""How `forge-stream engine vllm` moves vLLM to a new policy version, and proves it (forge_stream.engine.vllm_engine
has the engine front this serves, and why it loads the way it does).

`follow_policy` follows forge.policy and hands the newest version to `load_version`, which holds the checkpoint's
files, announces a version whose weights are the served ones without a reload (`_rename`), and otherwise drains the
requests in flight, loads it with the plan of forge_stream.engine.vllm_sync and probes it: vLLM's prompt log-probs
of a fixed token sequence (`probe_ids`) must match the checkpoint's own under transformers (`reference_logprobs`)
within PROBE_TOLERANCE, or the previous checkpoint is loaded back.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import httpx
import orjson

from forge_stream.engine.policy_watch import newest
from forge_stream.engine.vllm_engine import EngineState, _exit
from forge_stream.engine.vllm_holds import hold_checkpoint, weights_fingerprint
from forge_stream.engine.vllm_sync import Call, WorkerError
from forge_stream.kafka.follow import Follower
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

PROBE_TOKENS = 48  # prompt positions whose log-probs prove a reload
PROBE_TOLERANCE = 1e-3  # nats: fp32 CPU kernels agree with transformers to about 1e-5


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the same for every version)."""
    return [(17 + 7919 * i) % vocab_size for i in range(n)]


def reference_logprobs(model_dir: str, ids: list[int], dtype: str) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under the checkpoint in `model_dir`, with transformers on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [logits[i - 1, ids[i]].item() for i in range(1, len(ids))]


async def follow_policy(state: EngineState) -> None:
    """Load each newer version of the run into vLLM (the history's newest first), until cancelled. After a load
    (seconds), and after the wait of `load_interval_s` that follows it, the newest of all that was published
    meanwhile is next: the versions between are skipped."""
    settings = state.settings
    async with Follower(settings.bootstrap, TOPICS.policy, settings.policy_run) as policy:
        pending = await policy.backlog()
        while True:
            target = newest(pending, state.gate.version, state.checkpoint)
            if target is not None and time.monotonic() < state.load_after:
                await asyncio.sleep(state.load_after - time.monotonic())
                target = newest([target, *await policy.caught_up()], state.gate.version, state.checkpoint)
            if target is not None:
                loads = state.loads
                await load_version(state, target["checkpoint_uri"], target["version"])
                if state.loads > loads:  # a reload (a rename costs no drain): the next one waits
                    state.load_after = time.monotonic() + settings.load_interval_s
            pending = await policy.caught_up() or await policy.next()


async def load_version(state: EngineState, checkpoint: str, version: int) -> bool:
    """Move vLLM to `version` (see the module docstring); True if it serves it now."""
    settings = state.settings
    began = time.monotonic()
    held = None
    try:
        held = await asyncio.to_thread(hold_checkpoint, checkpoint, state.holds, version)
        fingerprint = await asyncio.to_thread(weights_fingerprint, held)
        if fingerprint is not None and fingerprint == await _served_fingerprint(state):
            return await _rename(state, checkpoint, held, version, began)
        expected = None
        if settings.probe:
            ids = probe_ids(_vocab_size(str(held)))
            expected = await asyncio.to_thread(reference_logprobs, str(held), ids, settings.dtype)
    except (OSError, ValueError) as exc:
        if held is not None:
            shutil.rmtree(held, ignore_errors=True)
        state.failed_loads += 1
        log.warning("cannot read policy version %s at %s (%s); still serving version %s", version, checkpoint, exc,
                    state.gate.version)
        return False
    closing = time.monotonic()  # from here new requests wait: first for those in flight to end, then for the load
    await state.gate.close()
    drained = time.monotonic()
    try:
        proof = await state.control.load(str(held), version)
        mismatch = await _probe(state, ids, expected) if expected is not None else None
    except (WorkerError, httpx.HTTPError, OSError) as exc:
        state.failed_loads += 1
        log.error("policy version %s from %s was not proven (%s); loading version %s back", version, checkpoint,
                  exc, state.gate.version)
        try:
            await state.control.load(state.serving, state.gate.version)
        except (WorkerError, httpx.HTTPError, OSError) as again:
            _exit(state, f"vLLM could not load version {state.gate.version} back either ({again})")
        shutil.rmtree(held, ignore_errors=True)
        state.gate.reopen(state.gate.version)
        return False
    if state.serving != settings.model:
        shutil.rmtree(state.serving, ignore_errors=True)
    state.checkpoint, state.serving, state.fingerprint = checkpoint, str(held), fingerprint
    state.loads, state.last_mismatch = state.loads + 1, mismatch
    state.gate.reopen(version)
    log.info("serving policy version %s from %s: %d checksums equal the checkpoint's, %d of %d fused changed, probe "
             "log-probs within %s of transformers', prefix cache reset%s; new requests held %.2fs (%.2fs waiting for "
             "those in flight, %.2fs loading), %.2fs in all",
             version, checkpoint, proof.matched, proof.fused_changed, proof.fused,
             f"{mismatch:.1e}" if mismatch is not None else "(no probe)",
             " (LMCache's too)" if state.control.reset_external else "", time.monotonic() - closing,
             drained - closing, time.monotonic() - drained, time.monotonic() - began)
    return True


async def _served_fingerprint(state: EngineState) -> str | None:
    """The served weights' fingerprint (weights_fingerprint), computed once for the start-up model."""
    if state.fingerprint is None:
        state.fingerprint = await asyncio.to_thread(weights_fingerprint, state.serving)
    return state.fingerprint


async def _rename(state: EngineState, checkpoint: str, held: Path, version: int, began: float) -> bool:
    """Announce `version`, whose weights are the served ones, without a drain or a reload: the requests in flight
    finish under the old version's name, new ones start under the new one (the same weights either way)."""
    previous = state.gate.version
    try:
        await state.control.call(Call("POST", "/update_weight_version", body={"new_version": str(version)}))
    except (WorkerError, httpx.HTTPError) as exc:
        shutil.rmtree(held, ignore_errors=True)
        state.failed_loads += 1
        log.warning("could not name version %s in vLLM (%s); still serving version %s", version, exc, previous)
        return False
    if state.serving != state.settings.model:
        shutil.rmtree(state.serving, ignore_errors=True)
    state.checkpoint, state.serving, state.renamed = checkpoint, str(held), state.renamed + 1
    state.gate.reopen(version)
    log.info("serving policy version %s from %s: its weights are version %s's, byte for byte (a step that changed no "
             "weight), so it is announced without a reload (%.2fs)", version, checkpoint, previous,
             time.monotonic() - began)
    return True


def _vocab_size(model_dir: str) -> int:
    config = orjson.loads((Path(model_dir) / "config.json").read_bytes())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


async def _probe(state: EngineState, ids: list[int], expected: list[float]) -> float:
    """vLLM's prompt log-probs of `ids` (sent straight to vLLM: the gate is closed) against `expected`; the largest
    difference, or WorkerError past PROBE_TOLERANCE."""
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": state.settings.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    served = response.json()["choices"][0]["prompt_logprobs"]
    got = [served[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    worst = max(abs(a - b) for a, b in zip(got, expected))
    if worst > PROBE_TOLERANCE:
        raise WorkerError(f"probe log-probs differ from the checkpoint's by up to {worst:.3g} nats")
    return worst
