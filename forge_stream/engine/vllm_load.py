"""How `forge-stream engine vllm` moves vLLM to a new policy version, and proves it (forge_stream.engine.vllm_engine
has the engine front this serves, and why it loads the way it does).

`follow_policy` follows forge.policy and hands the newest version to `load_version`, which holds the checkpoint's
files, announces a version whose weights are the served ones without a reload (`_rename`), and otherwise drains the
requests in flight, loads it with the plan of forge_stream.engine.vllm_sync and probes it: vLLM's prompt log-probs
of a fixed token sequence must match the checkpoint's own under transformers (forge_stream.engine.vllm_probe), or
the previous checkpoint is loaded back. A version that is a LoRA adapter goes to forge_stream.engine.vllm_lora
instead: loaded beside the base model under a name of its own, without a drain.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

import httpx

from forge_stream import lora
from forge_stream.engine.policy_watch import newest
from forge_stream.engine.vllm_engine import EngineState, _exit
from forge_stream.engine.vllm_holds import hold_checkpoint, weights_fingerprint
from forge_stream.engine.vllm_lora import load_adapter
from forge_stream.engine.vllm_probe import probe, probe_ids, reference_logprobs, vocab_size
from forge_stream.engine.vllm_sync import Call, WorkerError
from forge_stream.files import in_store
from forge_stream.kafka.follow import Follower
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

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
    source = in_store(settings.checkpoint_dir, checkpoint)
    if source is None:
        state.failed_loads += 1
        log.warning("policy version %s at %s is outside the engine's checkpoint directory (--checkpoint-dir %s): not "
                    "loaded; still serving version %s", version, checkpoint, settings.checkpoint_dir,
                    state.gate.version)
        return False
    held = None
    try:
        held = await asyncio.to_thread(hold_checkpoint, str(source), state.holds, version)
        if lora.is_adapter(held):
            return await load_adapter(state, checkpoint, held, version, began)
        fingerprint = await asyncio.to_thread(weights_fingerprint, held)
        if fingerprint is not None and fingerprint == await _served_fingerprint(state):
            return await _rename(state, checkpoint, held, version, began)
        expected = None
        if settings.probe:
            ids = probe_ids(vocab_size(held))
            expected = await asyncio.to_thread(reference_logprobs, str(held), ids, settings)
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
        mismatch = await probe(state, ids, expected) if expected is not None else None
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
    state.adapters = {}  # full weights: requests go to the base model's name
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
