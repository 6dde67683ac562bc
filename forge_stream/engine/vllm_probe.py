"""The second proof of a loaded policy version in `forge-stream engine vllm`: vLLM's log-probs of a fixed token
sequence (`probe_ids`) must equal the version's own, computed with transformers (full weights) or peft (a LoRA
adapter on its base model) on this host's CPU, within PROBE_TOLERANCE. forge_stream.engine.vllm_load (full weights)
and forge_stream.engine.vllm_lora (adapters) use it.

Full weights are proven on the prompt log-probs of the whole sequence (`probe`), sent while the load holds every other
request. An adapter is loaded while agents keep sampling, and vLLM 0.32's CPU LoRA kernels cannot compute prompt
log-probs in a batch with other requests (punica's `add_lora_logits` meets one row per prompt position against one
LoRA index per sampled sequence, and the worker dies on the einsum), so an adapter is proven on decoding requests, as
agents' run: the top next-token log-probs after a few prefixes of the sequence (`probe_next`).
"""

from __future__ import annotations

from pathlib import Path

import orjson

from forge_stream import lora
from forge_stream.engine.vllm_engine import EngineState, VllmEngineSettings
from forge_stream.engine.vllm_sync import WorkerError

PROBE_TOKENS = 48  # prompt positions whose log-probs prove a reload
PROBE_TOLERANCE = 1e-3  # nats: fp32 CPU kernels agree with transformers to about 1e-5
NEXT_PREFIXES = (12, 24, 36, PROBE_TOKENS)  # probe_next: the prefixes whose next-token distribution is compared
NEXT_TOP = 20  # probe_next: log-probs compared after each prefix (vLLM's most likely tokens)


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> list[int]:
    """A fixed token sequence spread over the vocabulary (the same for every version)."""
    return [(17 + 7919 * i) % vocab_size for i in range(n)]


def reference_logprobs(model_dir: str, ids: list[int], settings: VllmEngineSettings,
                       resident: lora.ResidentBase | None = None):
    """log p(. | ids[:i]) for i in 1..len(ids), a (len(ids), vocab) tensor, under the version in `model_dir` (full
    weights, or an adapter run by peft on its base model, not merged), on this process's CPU in the settings' dtype.
    An adapter goes onto `resident`'s base when one is given (read from disk once and kept, so a version costs its
    adapter), else onto a base read from disk.

    Beside vLLM on a CPU host it runs on one thread: vLLM's workers hold the cores, and with two threads each matrix
    product waits for the one that lost its core (SmolLM2-135M: 3-4 s a forward pass against 0.3-0.4 s)."""
    import torch

    if settings.runtime.target == "cpu":
        torch.set_num_threads(1)  # this front's only torch work is this reference
    if resident is not None and lora.is_adapter(model_dir):
        with resident.adapted(model_dir) as model:
            return _logprobs(model, ids)
    return _logprobs(lora.load_policy(model_dir, getattr(torch, settings.dtype), merge=False).eval(), ids)


def _logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def vocab_size(model_dir: str | Path) -> int:
    """The vocabulary of a version folder's model (an adapter's: its base model's)."""
    folder = Path(lora.adapter_base(model_dir) if lora.is_adapter(model_dir) else model_dir)
    config = orjson.loads((folder / "config.json").read_bytes())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


async def probe(state: EngineState, ids: list[int], expected, model: str | None = None) -> float:
    """vLLM's prompt log-probs of `ids` under `model` (default: the served name; sent straight to vLLM, not through
    the gate) against `expected` (reference_logprobs); the largest difference, or WorkerError past PROBE_TOLERANCE."""
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": model or state.settings.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
        "temperature": 1.0})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    served = response.json()["choices"][0]["prompt_logprobs"]
    worst = max(abs(served[i][str(ids[i])]["logprob"] - expected[i - 1, ids[i]].item()) for i in range(1, len(ids)))
    return _within(worst)


async def probe_next(state: EngineState, ids: list[int], expected, model: str) -> float:
    """vLLM's NEXT_TOP most likely next tokens, with their log-probs, after each of NEXT_PREFIXES of `ids` under
    `model` (one decoding request a prefix, batched with whatever else vLLM runs) against `expected`
    (reference_logprobs); the largest difference, or WorkerError past PROBE_TOLERANCE."""
    prefixes = [ids[:n] for n in NEXT_PREFIXES]
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": model, "prompt": prefixes, "max_tokens": 1, "logprobs": NEXT_TOP, "temperature": 1.0,
        "return_tokens_as_token_ids": True})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    worst = 0.0
    for choice in response.json()["choices"]:
        row = expected[len(prefixes[choice["index"]]) - 1]
        top = choice["logprobs"]["top_logprobs"][0]
        if len(top) < NEXT_TOP:
            raise WorkerError(f"probe request: {len(top)} next-token log-probs, not {NEXT_TOP}")
        worst = max([worst] + [abs(value - row[int(token.removeprefix("token_id:"))].item())
                               for token, value in top.items()])
    return _within(worst)


def _within(worst: float) -> float:
    if worst > PROBE_TOLERANCE:
        raise WorkerError(f"probe log-probs differ from the checkpoint's by up to {worst:.3g} nats")
    return worst
