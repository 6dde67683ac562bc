"""How `forge-stream engine vllm --lora-rank R` moves vLLM to a LoRA adapter version (a run trained with `train
--lora-rank`), and proves it; load.py calls `load_adapter` for a version folder that holds an adapter
(forge_stream.lora.is_adapter).

vLLM serves adapters beside its base model, each under a name of its own, loaded at run time
(`POST /v1/load_lora_adapter`, with VLLM_ALLOW_RUNTIME_LORA_UPDATING set by the launcher). So a version needs no
drain and no pause: the adapter is loaded under a new name (`policy-v<version>-<hold>`), proven by the probe
(vLLM's next-token log-probs under the adapter, batched with the agents' requests, against peft's on this CPU,
reference_probe.sample_next and matched_next; peft's pass runs while vLLM loads and samples;
peft runs the adapter on a base model this front reads from disk at the first adapter version and keeps,
forge_stream.lora.ResidentBase, so a version costs its adapter's bytes and one forward pass, not a base load),
and then the front maps the version to that name: a request entering the gate from then on is sent to vLLM under the
new adapter's name and labelled with its version, whatever model name the agent sent, while those in flight finish
on the adapter they started with (a batch holds up to MAX_LORAS adapters, state.py). The previous adapter is
unloaded, and its held folder removed, once the last request sent under it has ended (EngineState.retire): vLLM
answers 404 for a request that reaches it under a name already unloaded, and reads the folder again for a waiting
request whenever the adapter is not among those it holds. An adapter that cannot be read or proven is
unloaded again and never announced (the failure is raised for forge_stream.engine.shared.follower to log): the last
proven version stays served. A version whose adapter is the served one byte for byte (a trainer step
that changed no weight) is announced on the served adapter.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch

from forge_stream import lora
from forge_stream.engine.shared.follower import Applied, NotServed
from forge_stream.engine.shared.probe import probe_ids
from forge_stream.engine.vllm_front.holds import weights_fingerprint
from forge_stream.engine.vllm_front.reference_probe import matched_next, reference_logprobs, sample_next, vocab_size
from forge_stream.engine.vllm_front.state import EngineState


async def load_adapter(state: EngineState, checkpoint: str, held: Path, version: int, began: float) -> Applied:
    """Serve the adapter in `held` (this engine's hold of `checkpoint`) as `version`; raises if it is not served
    (the caller removes `held`), with nothing of it left in vLLM."""
    settings = state.settings
    current = state.adapters.get(state.gate.version)
    fingerprint = await asyncio.to_thread(weights_fingerprint, held)
    if current is not None and fingerprint == state.fingerprint:  # a step that changed no weight
        return _rename(state, checkpoint, held, version, current, began)
    ids = probe_ids(vocab_size(held))
    if settings.probe and state.resident is None:  # the probe's base model, read at the first adapter, kept
        state.resident = lora.ResidentBase(getattr(torch, settings.dtype))
    name = f"policy-v{version}-{held.name.rsplit('-', 1)[-1]}"
    took: dict[str, float] = {}
    # peft's reference pass on this front's core while vLLM loads the adapter and samples the probe on its own
    results = await asyncio.gather(_reference(state, held, ids, took), _load_and_sample(state, held, ids, name, took),
                                   return_exceptions=True)  # both end before anything goes on: one holds the base
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        if "vLLM load" in took:  # loaded, not proven
            await state.unload_adapter(name)
        if isinstance(failed, NotServed):
            raise failed
        raise NotServed(f"LoRA adapter: it was not proven ({type(failed).__name__}: {failed})") from failed
    expected, rows = results
    try:
        mismatch = matched_next(rows, expected, state) if expected is not None else None
    except Exception as exc:
        await state.unload_adapter(name)
        raise NotServed(f"LoRA adapter: it was not proven ({type(exc).__name__}: {exc})") from exc
    previous = state.serving
    _switch(state, checkpoint, held, version, name, fingerprint, mismatch)
    if current is not None:
        await state.retire(current, previous)  # unloaded, its folder removed, once its last request has ended
    within = f"{mismatch:.1e}" if mismatch is not None else "(no probe)"
    timings = ", ".join(f"{step} {took[step]:.2f}s" for step in ("peft reference", "vLLM load", "vLLM probe")
                        if step in took)
    return Applied(True, f"LoRA adapter {name} ({lora.weight_bytes(held)} bytes) loaded, probe log-probs within "
                         f"{within} of peft's; no request held; {timings}; {time.monotonic() - began:.2f}s in all")


async def _reference(state: EngineState, held: Path, ids: list[int], took: dict[str, float]):
    """peft's log-probs of the probe sequence under the adapter in `held` (None when the probe is off)."""
    if not state.settings.probe:
        return None
    start = time.monotonic()
    expected = await asyncio.to_thread(reference_logprobs, str(held), ids, state.settings, state.resident)
    took["peft reference"] = time.monotonic() - start
    return expected


async def _load_and_sample(state: EngineState, held: Path, ids: list[int], name: str, took: dict[str, float]):
    """Load the adapter in `held` into vLLM as `name`, then sample the probe under it (None when the probe is off)."""
    start = time.monotonic()
    try:
        await state.lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(held)})
    except Exception as exc:
        raise NotServed(f"LoRA adapter: vLLM did not load it ({type(exc).__name__}: {exc})") from exc
    took["vLLM load"] = time.monotonic() - start
    if not state.settings.probe:
        return None
    start = time.monotonic()
    rows = await sample_next(state, ids, name)
    took["vLLM probe"] = time.monotonic() - start
    return rows


def _switch(state: EngineState, checkpoint: str, held: Path, version: int, name: str, fingerprint: str | None,
            mismatch: float | None) -> None:
    """From now on requests enter under `version`, sent to adapter `name` (loaded from `held`)."""
    state.adapters = {version: name}
    state.checkpoint, state.serving, state.fingerprint = checkpoint, str(held), fingerprint
    state.last_mismatch = mismatch
    state.gate.reopen(version)


def _rename(state: EngineState, checkpoint: str, held: Path, version: int, name: str, began: float) -> Applied:
    """Announce `version`, whose adapter is the served one byte for byte, on the served adapter: no load, and vLLM
    keeps the folder it loaded the adapter from."""
    shutil.rmtree(held, ignore_errors=True)
    previous = state.gate.version
    state.adapters = {version: name}
    state.checkpoint = checkpoint
    state.gate.reopen(version)
    return Applied(False, f"its adapter is version {previous}'s, byte for byte (a step that changed no weight), so it "
                          f"is announced on adapter {name} without a load ({time.monotonic() - began:.2f}s)")

