"""The second proof of a loaded policy version in `forge-stream engine vllm`: vLLM's prompt log-probs of the probe
sequence (forge_stream.engine.probe) must equal the version's own, computed with transformers (full weights) or peft
(a LoRA adapter on its base model) on this host's CPU, within the tolerance of the served dtype.
forge_stream.engine.vllm_load (full weights) and forge_stream.engine.vllm_lora (adapters) use it.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from forge_stream import lora
from forge_stream.engine.probe import model_logprobs, worst_difference
from forge_stream.engine.vllm_state import EngineState, VllmEngineSettings
from forge_stream.engine.vllm_sync import WorkerError


def reference_logprobs(model_dir: str, ids: list[int], settings: VllmEngineSettings,
                       resident: lora.ResidentBase | None = None) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1 under the version in `model_dir` (full weights, or an adapter run by peft
    on its base model, not merged), on this process's CPU in the settings' dtype. An adapter goes onto `resident`'s
    base when one is given (read from disk once and kept, so a version costs its adapter), else onto a base read
    from disk.

    Beside vLLM on a CPU host it runs on one thread: vLLM's workers hold the cores, and with two threads each matrix
    product waits for the one that lost its core (SmolLM2-135M: 3-4 s a forward pass against 0.3-0.4 s)."""
    import torch

    if settings.runtime.target == "cpu":
        torch.set_num_threads(1)  # this front's only torch work is this reference
    if resident is not None and lora.is_adapter(model_dir):
        with resident.adapted(model_dir) as model:
            return model_logprobs(model, ids)
    return model_logprobs(lora.load_policy(model_dir, getattr(torch, settings.dtype), merge=False).eval(), ids)


def vocab_size(model_dir: str | Path) -> int:
    """The vocabulary of a version folder's model (an adapter's: its base model's)."""
    folder = Path(lora.adapter_base(model_dir) if lora.is_adapter(model_dir) else model_dir)
    config = orjson.loads((folder / "config.json").read_bytes())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


async def probe(state: EngineState, ids: list[int], expected: list[float], model: str | None = None) -> float:
    """vLLM's prompt log-probs of `ids` under `model` (default: the served name; sent straight to vLLM, not through
    the gate) against `expected`; the largest difference, or WorkerError if they do not match
    (forge_stream.engine.probe.worst_difference)."""
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": model or state.settings.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
        "temperature": 1.0})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    served = response.json()["choices"][0]["prompt_logprobs"]
    got = [served[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    worst, problem = worst_difference(got, expected, state.settings.dtype)
    if problem is not None:
        raise WorkerError(problem)
    return worst
