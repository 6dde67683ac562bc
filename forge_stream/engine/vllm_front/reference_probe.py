"""The second proof of a loaded policy version in `forge-stream engine vllm`: vLLM's log-probs of the probe sequence
(forge_stream.engine.shared.probe) must equal the version's own, computed with transformers (full weights) or peft (a
LoRA adapter on its base model) on this host's CPU, within the tolerance of the served dtype. load.py (full weights)
and adapters.py (adapters) use it.

Full weights are proven on the prompt log-probs of the whole sequence (`probe`), sent while the load holds every other
request. An adapter is loaded while agents keep sampling, and vLLM 0.32's CPU LoRA kernels cannot compute prompt
log-probs in a batch with other requests (punica's `add_lora_logits` meets one row per prompt position against one
LoRA index per sampled sequence, and the worker dies on the einsum), so an adapter is proven on decoding requests, as
agents' run: the top next-token log-probs after a few prefixes of the sequence (`sample_next`, `matched_next`).
"""

from __future__ import annotations

from pathlib import Path

import orjson

from forge_stream import lora
from forge_stream.engine.shared.probe import PROBE_TOKENS, logprobs_from_rows, model_logprob_rows, worst_difference
from forge_stream.engine.vllm_front.load_plan import WorkerError
from forge_stream.engine.vllm_front.state import EngineState, VllmEngineSettings

NEXT_PREFIXES = (12, 24, 36, PROBE_TOKENS)  # sample_next: the prefixes whose next-token distribution is compared
NEXT_TOP = 20  # sample_next: log-probs compared after each prefix (vLLM's most likely tokens)
PROBE_PRIORITY = -1  # sample_next: below agents' 0, so vLLM (--scheduling-policy priority) schedules a probe first


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
            return model_logprob_rows(model, ids)
    return model_logprob_rows(lora.load_policy(model_dir, getattr(torch, settings.dtype), merge=False).eval(), ids)


def vocab_size(model_dir: str | Path) -> int:
    """The vocabulary of a version folder's model (an adapter's: its base model's)."""
    folder = Path(lora.adapter_base(model_dir) if lora.is_adapter(model_dir) else model_dir)
    config = orjson.loads((folder / "config.json").read_bytes())
    return int(config.get("vocab_size") or config.get("text_config", {})["vocab_size"])


async def probe(state: EngineState, ids: list[int], expected: list[float], model: str | None = None) -> float:
    """vLLM's prompt log-probs of `ids` under `model` (default: the served name; sent straight to vLLM, not through
    the gate) against `expected` (reference_logprobs); the largest difference, or WorkerError if they do not match
    (forge_stream.engine.shared.probe.worst_difference)."""
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": model or state.settings.name, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
        "temperature": 1.0})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    served = response.json()["choices"][0]["prompt_logprobs"]
    got = [served[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    return _matched(got, logprobs_from_rows(expected, ids), state)


async def sample_next(state: EngineState, ids: list[int], model: str) -> list[tuple[int, dict[int, float]]]:
    """vLLM's NEXT_TOP most likely next tokens, with their log-probs, after each of NEXT_PREFIXES of `ids` under
    `model` (one decoding request a prefix, batched with whatever else vLLM runs, ahead of agents' requests that
    wait): (prefix length, {token id: log-prob}) a prefix, for `matched_next`."""
    prefixes = [ids[:n] for n in NEXT_PREFIXES]
    response = await state.control.client.post(state.vllm_url + "/v1/completions", json={
        "model": model, "prompt": prefixes, "max_tokens": 1, "logprobs": NEXT_TOP, "temperature": 1.0,
        "return_tokens_as_token_ids": True, "cache_salt": f"probe.{model}",  # no KV but this adapter's own
        **_first(state.settings)})
    if response.status_code != 200:
        raise WorkerError(f"probe request: HTTP {response.status_code} {response.text[:300]}")
    rows = []
    for choice in response.json()["choices"]:
        top = choice["logprobs"]["top_logprobs"][0]
        if len(top) < NEXT_TOP:
            raise WorkerError(f"probe request: {len(top)} next-token log-probs, not {NEXT_TOP}")
        rows.append((len(prefixes[choice["index"]]),
                     {int(token.removeprefix("token_id:")): value for token, value in top.items()}))
    return rows


def matched_next(rows: list[tuple[int, dict[int, float]]], expected, state: EngineState) -> float:
    """`sample_next`'s answer against `expected` (reference_logprobs): the largest difference, or WorkerError if they
    do not match."""
    got, want = [], []
    for length, top in rows:
        for token, value in top.items():
            got.append(value)
            want.append(expected[length - 1][token].item())
    return _matched(got, want, state)


def _first(settings: VllmEngineSettings) -> dict:
    """The request field that puts a probe ahead of agents' waiting requests, where vLLM schedules by priority."""
    return {"priority": PROBE_PRIORITY} if settings.lora_rank else {}


def _matched(got: list[float], expected: list[float], state: EngineState) -> float:
    worst, problem = worst_difference(got, expected, state.settings.dtype)
    if problem is not None:
        raise WorkerError(problem)
    return worst
