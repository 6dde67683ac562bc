"""`forge-stream bench prefix-tree`: one training step (forward + backward) tree-packed vs unshared, on CPU.

Three workloads (token ids drawn from a seeded generator, so every run scores the same sequences):
  (a) grpo: G completions of one long prompt;
  (b) multi_turn: agent rollouts where every turn is its own sample, append-only history, context reset
      every `reset_every` turns (the new context restarts from the task prompt plus a short summary);
  (c) long_horizon: a long agent rollout, every turn its own sample, no reset (T/U >= 40).
Tree step: `sequence_logprobs` over the packed tree (ancestor attention), loss = sum_i w_i * sum(lp_i) with
random per-sequence weights, backward. At a sampling `temperature` or `top_p` other than 1 (what a trainer scores
sampled tokens at: `path_logprobs` with the settings per row, the trainer's path), every token's log-prob is that of
the processed distribution, both ways; top-p sorts each scored row's whole vocabulary. Baseline: the same loss without sharing, as length-sorted right-padded
batches under a padded-token budget, each batch's backward run before the next batch (gradient accumulation,
the fastest way that keeps memory bounded). Each variant runs in its own spawned process: the fastest of `repeats`
steps after a small warm-up, and peak RSS growth during the steps (Linux VmHWM reset through /proc/self/clear_refs;
gradient buffers already exist, so this is activation memory).
"""

from __future__ import annotations

import gc
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
import multiprocessing

import torch


@dataclass(frozen=True)
class BenchSettings:
    threads: int = 2
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 4096
    batch_tokens: int = 16384  # baseline padded tokens per batch
    chunk_rows: int = 256  # tree attention query chunk
    repeats: int = 2  # timed steps per variant; the fastest counts
    seed: int = 0
    model_dir: str | None = None  # a real model directory instead of a random Llama of the sizes above
    head_rows: int = 1024  # LM-head rows scored at a time (logits of at most head_rows x vocab exist)
    temperature: float = 1.0  # the sampling settings every token is scored at (1, 1: the model's own distribution)
    top_p: float = 1.0
    # (a) GRPO
    grpo_prompt: int = 2048
    grpo_group: int = 16
    grpo_completion: tuple[int, int] = (64, 192)
    # (b) multi-turn agent
    mt_rollouts: int = 4
    mt_prompt: int = 256
    mt_turns: int = 16
    mt_reset_every: int = 8
    mt_observation: int = 32
    mt_action: int = 64
    mt_summary: int = 32
    # (c) long-horizon agent
    lh_rollouts: int = 1
    lh_prompt: int = 128
    lh_turns: int = 80
    lh_observation: int = 6
    lh_action: int = 10


QUICK = BenchSettings(
    hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, batch_tokens=4096, chunk_rows=64, repeats=1,
    grpo_prompt=256, grpo_group=8, grpo_completion=(16, 48),
    mt_rollouts=2, mt_prompt=64, mt_turns=8, mt_reset_every=4, mt_observation=8, mt_action=16, mt_summary=8,
    lh_prompt=32, lh_turns=40, lh_observation=3, lh_action=5,
)  # fmt: skip


def _tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def grpo_workload(s: BenchSettings, gen: torch.Generator) -> list[list[int]]:
    prompt = _tokens(gen, s.vocab_size, s.grpo_prompt)
    lo, hi = s.grpo_completion
    lengths = torch.randint(lo, hi + 1, (s.grpo_group,), generator=gen).tolist()
    return [prompt + _tokens(gen, s.vocab_size, n) for n in lengths]


def agent_workload(
    s: BenchSettings, gen: torch.Generator, *, rollouts: int, prompt_len: int, turns: int,
    reset_every: int | None, observation: int, action: int, summary: int = 0,
) -> list[list[int]]:
    """One sample per turn: the turn's context (append-only since the last reset) plus its action."""
    prompt = _tokens(gen, s.vocab_size, prompt_len)
    samples = []
    for _ in range(rollouts):
        history = list(prompt)
        for turn in range(turns):
            if reset_every and turn and turn % reset_every == 0:
                history = prompt + _tokens(gen, s.vocab_size, summary)
            history = history + _tokens(gen, s.vocab_size, observation) + _tokens(gen, s.vocab_size, action)
            samples.append(history)
    return samples


def workloads(s: BenchSettings) -> dict[str, list[list[int]]]:
    gen = torch.Generator().manual_seed(s.seed)
    return {
        "grpo": grpo_workload(s, gen),
        "multi_turn": agent_workload(
            s, gen, rollouts=s.mt_rollouts, prompt_len=s.mt_prompt, turns=s.mt_turns, reset_every=s.mt_reset_every,
            observation=s.mt_observation, action=s.mt_action, summary=s.mt_summary,
        ),
        "long_horizon": agent_workload(
            s, gen, rollouts=s.lh_rollouts, prompt_len=s.lh_prompt, turns=s.lh_turns, reset_every=None,
            observation=s.lh_observation, action=s.lh_action,
        ),
    }  # fmt: skip


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def tree_step(model, seqs, weights, s: BenchSettings) -> list[torch.Tensor]:
    """Forward + backward of sum_i w_i * sum(lp_i) over the packed tree; returns the detached log-probs."""
    from forge_stream.tree import pack, sequence_logprobs
    from forge_stream.tree.logprobs import path_logprobs

    packed = pack(seqs)
    if s.temperature == 1.0 and s.top_p == 1.0:
        lps = sequence_logprobs(model, packed, chunk_rows=s.chunk_rows, head_rows=s.head_rows)
    else:  # the trainer's path: each scored row at the settings it was sampled with
        rows = torch.cat([path[1:] for path in packed.paths])
        lp = path_logprobs(model, packed, rows, chunk_rows=s.chunk_rows, head_rows=s.head_rows,
                           temperature=torch.full((len(rows),), s.temperature, dtype=torch.float64),
                           top_p=torch.full((len(rows),), s.top_p, dtype=torch.float64))
        lps = list(lp.split([len(path) - 1 for path in packed.paths]))
    sum(w * lp.sum() for w, lp in zip(weights, lps)).backward()
    return [lp.detach() for lp in lps]


def baseline_step(model, seqs, weights, s: BenchSettings) -> list[torch.Tensor]:
    """The same loss without sharing: padded length-sorted batches, backward per batch."""
    from forge_stream.tree.reference import length_batches, padded_batch_logprobs

    out: list = [None] * len(seqs)
    for batch in length_batches([len(x) for x in seqs], s.batch_tokens):
        lps = padded_batch_logprobs(model, [seqs[i] for i in batch], temperature=s.temperature, top_p=s.top_p)
        sum(weights[i] * lp.sum() for i, lp in zip(batch, lps)).backward()
        for i, lp in zip(batch, lps):
            out[i] = lp.detach()
    return out


# Agent-shaped workloads sized for a real model (a 135M model steps through each in seconds to a minute on 2
# cores); token ids are drawn from the model's own vocabulary.
MODEL_SHAPES = BenchSettings(
    batch_tokens=4096, chunk_rows=256, repeats=1,
    grpo_prompt=512, grpo_group=8, grpo_completion=(32, 96),
    mt_rollouts=2, mt_prompt=256, mt_turns=8, mt_reset_every=4, mt_observation=24, mt_action=32, mt_summary=16,
    lh_prompt=128, lh_turns=40, lh_observation=6, lh_action=10,
)  # fmt: skip

# Variants: the tree step with the LM head chunked (`head_rows`) and whole (every row's logits at once: the
# before-and-after of chunking, measured on a real model's vocabulary), and the unshared baseline.
WHOLE_HEAD = 1 << 30


def _model(s: BenchSettings):
    if s.model_dir is not None:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(s.model_dir, dtype=torch.float32).train()
    from forge_stream.tree.reference import tiny_causal_lm

    return tiny_causal_lm(
        "llama", vocab_size=s.vocab_size, hidden_size=s.hidden_size, num_layers=s.num_layers,
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, seed=s.seed,
    )  # fmt: skip


def _measure(variant: str, name: str, s: BenchSettings) -> dict:
    """Runs in a fresh process: build model + workload, warm up, then time one step and its peak RSS growth."""
    torch.set_num_threads(s.threads)
    model = _model(s)
    seqs = workloads(s)[name]
    weights = torch.randn(len(seqs), generator=torch.Generator().manual_seed(s.seed + 1)).tolist()
    if variant == "tree_whole_head":
        s = replace(s, head_rows=WHOLE_HEAD)
    step = baseline_step if variant == "baseline" else tree_step
    step(model, [x[:64] for x in seqs[:2]], weights, s)  # warm-up; also allocates the .grad buffers
    model.zero_grad(set_to_none=False)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base_kb = _rss_kb("VmRSS:")
    times = []
    for _ in range(s.repeats):  # best of `repeats`: the machine is shared and noisy
        model.zero_grad(set_to_none=False)
        start = time.perf_counter()
        lps = step(model, seqs, weights, s)
        times.append(time.perf_counter() - start)
    peak_kb = _rss_kb("VmHWM:")
    return {"seconds": min(times), "peak_mb": (peak_kb - base_kb) / 1024, "logprobs": torch.cat(lps)}


def scored_at(s: BenchSettings) -> dict:
    """What distribution the steps score every token under, for the JSON."""
    if (s.temperature, s.top_p) == (1.0, 1.0):
        path = "the model's own distribution"
    elif s.top_p < 1.0:
        path = "logits / temperature, then the top-p nucleus (a sort of each scored row's whole vocabulary)"
    else:
        path = "logits / temperature"
    return {"temperature": s.temperature, "top_p": s.top_p, "path": path}


def run(settings: BenchSettings | None = None, *, quick: bool = False, threads: int | None = None,
        model_dir: str | None = None, temperature: float | None = None, top_p: float | None = None) -> dict:
    """Measure every workload tree vs baseline; one dict with a `workloads` list (see module docstring).
    `model_dir`: step a real model (its vocabulary, agent-shaped workloads of MODEL_SHAPES), and measure the
    tree step with the LM head whole beside it. `temperature`, `top_p`: score every token at these sampling
    settings."""
    from forge_stream.tree import pack

    s = settings or (QUICK if quick else MODEL_SHAPES if model_dir else BenchSettings())
    if threads is not None:
        s = replace(s, threads=threads)
    if temperature is not None:
        s = replace(s, temperature=temperature)
    if top_p is not None:
        s = replace(s, top_p=top_p)
    model_info = None
    if model_dir is not None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        s = replace(s, model_dir=str(model_dir), vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                    num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                    num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads))
        model_info = {"path": str(model_dir), "architecture": (config.architectures or ["?"])[0],
                      "vocab_size": config.vocab_size}
    variants = ("tree", "tree_whole_head", "baseline") if model_dir else ("tree", "baseline")
    results = []
    ctx = multiprocessing.get_context("spawn")
    for name, seqs in workloads(s).items():
        tree = pack(seqs)
        measured = {}
        for variant in variants:
            print(f"prefix-tree: {name} {variant} (T={tree.total_tokens}, U={tree.num_rows})", file=sys.stderr)
            with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
                measured[variant] = pool.submit(_measure, variant, name, s).result()
        t, b = measured["tree"], measured["baseline"]
        ratio = tree.total_tokens / tree.num_rows
        speedup = b["seconds"] / t["seconds"]
        results.append(
            {
                "name": name,
                "sequences": tree.num_sequences,
                "T": tree.total_tokens,
                "U": tree.num_rows,
                "T_over_U": round(ratio, 3),
                "tree_step_s": round(t["seconds"], 3),
                "baseline_step_s": round(b["seconds"], 3),
                "speedup": round(speedup, 3),
                "speedup_over_T_over_U": round(speedup / ratio, 3),
                "tree_peak_mb": round(t["peak_mb"], 1),
                "baseline_peak_mb": round(b["peak_mb"], 1),
                "max_logprob_diff": float((t["logprobs"] - b["logprobs"]).abs().max()),
            }
        )
        if "tree_whole_head" in measured:
            w = measured["tree_whole_head"]
            results[-1].update(tree_whole_head_step_s=round(w["seconds"], 3),
                               tree_whole_head_peak_mb=round(w["peak_mb"], 1))
    return {
        "benchmark": "prefix-tree",
        "device": "cpu",
        "settings": asdict(s),
        "model": model_info,
        "step": "forward + backward of sum_i w_i * sum_t logp_it, float32, "
                + (model_info["architecture"] if model_info else "Llama-style model (GQA)"),
        "scored_at": scored_at(s),
        "workloads": results,
    }
