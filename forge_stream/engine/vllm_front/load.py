"""How `forge-stream engine vllm` moves vLLM to a new policy version, and proves it: the vLLM engine's `apply` for
forge_stream.engine.shared.follower (app.py has the engine front this serves, and why it loads the way it does).

`load_version` holds the checkpoint's files, announces a version whose weights are the served ones without a reload
(`_rename`), and otherwise drains the requests in flight, loads it with the plan of load_plan.py and probes it: vLLM's
prompt log-probs of a fixed token sequence must match the checkpoint's own under transformers (reference_probe.py), or
the previous checkpoint is loaded back. A version that is a LoRA adapter goes to adapters.py instead: loaded beside
the base model under a name of its own, without a drain.

Whatever fails, and wherever (an unreadable file, an error parsing vLLM's answer, transformers failing on the
checkpoint), leaves vLLM serving the last proven version, awake, behind an open gate: the held folder is removed,
and after the drain the served weights are loaded back, or, if vLLM cannot take them back either, the process ends
for its supervisor to start afresh. The failure is raised for the follower to log.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from forge_stream import lora
from forge_stream.engine.shared.follower import Applied, NotServed
from forge_stream.engine.shared.probe import probe_ids
from forge_stream.engine.vllm_front.adapters import load_adapter
from forge_stream.engine.vllm_front.holds import hold_checkpoint, weights_fingerprint
from forge_stream.engine.vllm_front.load_plan import Call
from forge_stream.engine.vllm_front.reference_probe import probe, reference_logprobs, vocab_size
from forge_stream.engine.vllm_front.state import EngineState, exit_engine
from forge_stream.files import in_store

log = logging.getLogger(__name__)


async def load_version(state: EngineState, checkpoint: str, version: int) -> Applied:
    """Move vLLM to `version` (see the module docstring); raises, with vLLM on its last proven version, if it
    cannot."""
    began = time.monotonic()
    source = in_store(state.settings.checkpoint_dir, checkpoint)
    if source is None:
        raise NotServed(f"it is outside the engine's checkpoint directory (--checkpoint-dir "
                        f"{state.settings.checkpoint_dir})")
    try:
        held = await asyncio.to_thread(hold_checkpoint, str(source), state.holds, version)
    except OSError as exc:
        raise NotServed(f"cannot read it ({exc})") from exc
    try:
        if lora.is_adapter(held):
            return await load_adapter(state, checkpoint, held, version, began)
        fingerprint = await asyncio.to_thread(weights_fingerprint, held)
        if fingerprint is not None and fingerprint == await _served_fingerprint(state):
            return await _rename(state, checkpoint, held, version, began)
        return await _reload(state, checkpoint, held, version, fingerprint, began)
    except Exception:
        if str(held) != state.serving:
            shutil.rmtree(held, ignore_errors=True)
        raise


async def _reload(state: EngineState, checkpoint: str, held: Path, version: int, fingerprint: str | None,
                  began: float) -> Applied:
    """Drain, load `held` into vLLM, prove it, and open the gate under `version`."""
    settings = state.settings
    expected = None
    if settings.probe:  # the checkpoint's own log-probs, while vLLM still serves
        ids = probe_ids(vocab_size(held))
        expected = await asyncio.to_thread(reference_logprobs, str(held), ids, settings)
    closing = time.monotonic()  # from here new requests wait: first for those in flight to end, then for the load
    await state.gate.close()
    drained = time.monotonic()
    try:
        proof = await state.control.load(str(held), version)
        mismatch = await probe(state, ids, expected) if expected is not None else None
    except Exception as exc:
        await _load_back(state)
        raise NotServed(f"it was not proven ({type(exc).__name__}: {exc}); version {state.gate.version}'s weights "
                        "were loaded back") from exc
    if state.serving != settings.model:
        shutil.rmtree(state.serving, ignore_errors=True)
    state.checkpoint, state.serving, state.fingerprint = checkpoint, str(held), fingerprint
    state.last_mismatch = mismatch
    state.adapters = {}  # full weights: requests go to the base model's name
    state.gate.reopen(version)
    within = f"{mismatch:.1e}" if mismatch is not None else "(no probe)"
    lmcache = " (LMCache's too)" if state.control.reset_external else ""
    return Applied(True, (
        f"{proof.matched} checksums equal the checkpoint's, {proof.fused_changed} of {proof.fused} fused changed, "
        f"probe log-probs within {within} of transformers', prefix cache reset{lmcache}; new requests held "
        f"{time.monotonic() - closing:.2f}s ({drained - closing:.2f}s waiting for those in flight, "
        f"{time.monotonic() - drained:.2f}s loading), {time.monotonic() - began:.2f}s in all"))


async def _load_back(state: EngineState) -> None:
    """After a failed load behind the closed gate: vLLM serves the last proven weights again, awake, and the gate
    opens under their version; if vLLM cannot take them back, the process ends for its supervisor."""
    try:
        await state.control.load(state.serving, state.gate.version)
    except Exception as again:
        exit_engine(state, f"vLLM could not load version {state.gate.version} back either ({type(again).__name__}: "
                           f"{again})")
    state.gate.reopen(state.gate.version)


async def _served_fingerprint(state: EngineState) -> str | None:
    """The served weights' fingerprint (weights_fingerprint), computed once for the start-up model."""
    if state.fingerprint is None:
        state.fingerprint = await asyncio.to_thread(weights_fingerprint, state.serving)
    return state.fingerprint


async def _rename(state: EngineState, checkpoint: str, held: Path, version: int, began: float) -> Applied:
    """Announce `version`, whose weights are the served ones, without a drain or a reload: the requests in flight
    finish under the old version's name, new ones start under the new one (the same weights either way)."""
    previous = state.gate.version
    try:
        await state.control.call(Call("POST", "/update_weight_version", body={"new_version": str(version)}))
    except Exception as exc:
        raise NotServed(f"vLLM did not take its name ({type(exc).__name__}: {exc})") from exc
    if state.serving != state.settings.model:
        shutil.rmtree(state.serving, ignore_errors=True)
    state.checkpoint, state.serving = checkpoint, str(held)
    state.gate.reopen(version)
    return Applied(False, f"its weights are version {previous}'s, byte for byte (a step that changed no weight), so "
                          f"it is announced without a reload ({time.monotonic() - began:.2f}s)")
