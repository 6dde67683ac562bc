"""One tree-packed training step over decoded TrainSample records (pure: model, optimizer and records in,
stats out; no Kafka).

Each TrainSample is one group's prefix tree. A group larger than `token_budget` unique rows is split into runs
of its sequences whose tries fit (`split_sequences`; a longer path runs whole, with every turn it contains);
`micro_batches` takes consecutive trees (or parts) up to the budget; their sequences are re-packed into one trie,
so what groups share (system prompt, tool definitions) is computed once, and it runs through the model once, the LM head on the completion rows only
(`path_logprobs`), each token scored at the temperature and top_p its recorded log-prob was taken at (the
sequence's `temperature`, `top_p` and `logprobs_mode`, forge_stream.sampled_policy), so at the serving weights the
two agree. Each sequence's completion log-probs meet its recorded rollout log-probs and advantage in the
loss. The loss is normalised by the completion tokens of the whole step, so micro-batching and splitting leave
the gradient unchanged, and so does data parallelism: under torch.distributed (`train_step(..., ranks=...)`,
forge_stream.trainer.distributed) each rank trains its share of the trees with the whole batch's normalizer and
the ranks sum their gradients.

`StepConfig.loss` picks the loss and, unless `clip` is given, its own clip bounds (`LOSS_CLIP`: CISPO
eps_low None / eps_high 4.0, PPO 0.2 / 0.2); PPO also applies its dual clip `clip_ratio_c` (3.0; None: off).
A group whose every advantage is 0 (all its rollouts scored alike: a task the policy always or never solves)
adds nothing to the gradient of either loss, only its tokens to the normalizer: it is counted there and not run
through the model (`has_signal`), so the gradient is the one the whole batch gives at a fraction of the work
(`groups_without_signal` in the stats). A batch with no signal at all changes no weight.

Besides the loss, a step reports the train-inference mismatch over the tokens it trained (|logp - recorded logp|
mean and max, importance ratio mean and max, clip fraction) and the mean outcome reward of the batch's rollouts
(one value per distinct (group, rollout)); with several updates per batch, each update's too (`per_update`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal, Protocol, Sequence

import torch

from forge_stream.sampled_policy import recorded_settings
from forge_stream.trainer.losses import DUAL_CLIP, LOSS_CLIP, Clip, cispo_loss, ppo_clip_loss
from forge_stream.tree import PackedTree, from_arrays, pack, repack, sequence_logprobs, subtree
from forge_stream.tree.logprobs import path_logprobs


LossName = Literal["cispo", "ppo"]


@dataclass(frozen=True)
class StepConfig:
    loss: LossName = "cispo"
    clip: Clip | None = None  # None: the loss's own bounds (LOSS_CLIP)
    clip_ratio_c: float | None = DUAL_CLIP  # PPO's dual clip for negative advantages (None: off); CISPO ignores it
    lr: float = 1e-6
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    token_budget: int = 16384  # max unique tree rows per micro-batch forward
    chunk_rows: int = 256  # query rows per chunk of CPU tree attention
    checkpoint_layers: bool = True  # recompute each decoder layer in backward: activations O(U x hidden) per layer
    updates: int = 1  # optimizer updates per batch (sample reuse, like PPO's epochs); see train_step

    @property
    def bounds(self) -> Clip:
        return self.clip or LOSS_CLIP[self.loss]


def clip_for(loss: LossName, eps_low: float | None = None, eps_high: float | None = None) -> Clip:
    """The loss's own clip bounds with any given bound replaced (a CLI's --eps-low / --eps-high).

    >>> clip_for("ppo"), clip_for("cispo", eps_high=0.3), clip_for("ppo", eps_low=0.1)
    (Clip(low=0.2, high=0.2), Clip(low=None, high=0.3), Clip(low=0.1, high=0.2))
    """
    if loss not in LOSS_CLIP:
        raise ValueError(f"unknown loss {loss!r} (one of {', '.join(LOSS_CLIP)})")
    own = LOSS_CLIP[loss]
    return Clip(own.low if eps_low is None else eps_low, own.high if eps_high is None else eps_high)


UPDATE_STATS = ("loss", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "mismatch_mean", "mismatch_max")


@dataclass(frozen=True)
class StepStats:
    loss_name: str
    loss: float
    groups: int
    sequences: int
    total_tokens: int  # T
    unique_tokens: int  # U
    loss_tokens: int  # completion tokens trained
    tree_ratio: float  # T / U
    micro_batches: int
    grad_norm: float
    clip_fraction: float
    ratio_mean: float
    ratio_max: float
    mismatch_mean: float  # mean |logp at training - recorded logp| over the trained tokens
    mismatch_max: float
    mean_reward: float  # mean composite reward of the sequences
    outcome_reward: float  # mean outcome reward of the batch's rollouts
    rollouts: int
    staleness_mean: float
    staleness_max: int
    groups_without_signal: int  # groups whose every advantage is 0: in the normalizer, not run through the model
    per_update: list[dict]  # every update's UPDATE_STATS, in order (the fields above are the first update's)

    def as_dict(self) -> dict:
        return asdict(self)


def sample_tree(sample: dict) -> PackedTree:
    """The PackedTree of a decoded TrainSample; ValueError if its arrays or sequence refs are inconsistent."""
    tree = from_arrays(sample["token_ids"], sample["parent_row"], [s["last_row"] for s in sample["sequences"]])
    if tree.position_ids.tolist() != list(sample["position_ids"]) or tree.subtree_end.tolist() != list(
        sample["subtree_end"]
    ):
        raise ValueError(f"sample {sample.get('event_id')}: position_ids/subtree_end disagree with parent_row")
    for ref, length in zip(sample["sequences"], tree.lengths):
        if ref["length"] != length or not 1 <= ref["prompt_len"] <= length:
            raise ValueError(f"sample {sample.get('event_id')}: sequence {ref['completion_id']} has a bad length")
        if len(ref["old_logprobs"]) != length - ref["prompt_len"]:
            raise ValueError(f"sample {sample.get('event_id')}: sequence {ref['completion_id']} old_logprobs length")
    return tree


def micro_batches(trees: Sequence[PackedTree], token_budget: int) -> list[list[int]]:
    """Consecutive indices of trees grouped so each group's unique rows stay within the budget."""
    groups: list[list[int]] = []
    rows = 0
    for i, tree in enumerate(trees):
        if groups and rows + tree.num_rows <= token_budget:
            groups[-1].append(i)
            rows += tree.num_rows
        else:
            groups.append([i])
            rows = tree.num_rows
    return groups


def split_sequences(tree: PackedTree, token_budget: int) -> list[list[int]]:
    """The tree's sequence indices cut into runs whose tries fit `token_budget` rows, each run in index order.

    A run's trie has the rows of the union of its paths, which is what is counted. A path longer than the budget
    must run whole (its tokens need all of their prefix in the same forward pass), so the run it opens may grow to
    that path's length: the turns of a long session, each a prefix of the next, all join the run of the last one
    and cost no row twice. Longest paths first, each sequence goes to the run it adds the fewest rows to (the
    first such), or opens one.

    >>> split_sequences(pack([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7]]), 4)
    [[0, 1], [2, 3]]
    >>> split_sequences(pack([[1, 2], [1, 2, 3, 4], [1, 2, 3], [9, 9]]), 3)  # 0 and 2 ride on 1's path
    [[0, 1, 2], [3]]
    """
    if tree.num_rows <= token_budget:
        return [list(range(tree.num_sequences))]
    lengths = tree.lengths
    taken: list[torch.Tensor] = []  # rows of each run's trie
    rows: list[int] = []
    caps: list[int] = []
    runs: list[list[int]] = []
    for i in sorted(range(tree.num_sequences), key=lambda i: -lengths[i]):
        path = tree.paths[i]
        best: tuple[int, int] | None = None  # (new rows, run)
        for r, mask in enumerate(taken):
            new = int((~mask[path]).sum())
            if rows[r] + new <= caps[r] and (best is None or new < best[0]):
                best = (new, r)
        if best is None:
            taken.append(torch.zeros(tree.num_rows, dtype=torch.bool))
            rows.append(0)
            caps.append(max(token_budget, lengths[i]))
            runs.append([])
            best = (lengths[i], len(runs) - 1)
        new, r = best
        taken[r][path] = True
        rows[r] += new
        runs[r].append(i)
    return sorted(sorted(run) for run in runs)


def micro_batch_plan(samples: Sequence[dict], token_budget: int) -> list[tuple[PackedTree, list[dict]]]:
    """Each micro-batch's trie and the sequence refs of its paths, in order: the samples' trees, the larger ones
    split by `split_sequences` (each run's sub-trie cut out of the tree, `subtree`), grouped by `micro_batches`;
    a micro-batch of several trees is re-packed into one trie (what groups share is computed once)."""
    parts: list[tuple[PackedTree, list[dict]]] = []
    for sample in samples:
        tree = sample_tree(sample)
        runs = split_sequences(tree, token_budget)
        if len(runs) == 1:
            parts.append((tree, list(sample["sequences"])))
            continue
        for run in runs:
            parts.append((subtree(tree, run), [sample["sequences"][i] for i in run]))
    return [
        (parts[batch[0]][0] if len(batch) == 1 else repack([parts[i][0] for i in batch]),
         [ref for i in batch for ref in parts[i][1]])
        for batch in micro_batches([tree for tree, _ in parts], token_budget)
    ]


def build_optimizer(model: torch.nn.Module, config: StepConfig) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (with LoRA the adapter's only: the base model's are frozen)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(trained, lr=config.lr, weight_decay=config.weight_decay)


def has_signal(sample: dict) -> bool:
    """Whether a group can move the weights: some sequence has a non-zero advantage (both losses weigh every
    token by its advantage; there is no KL or entropy term)."""
    return any(ref["advantage"] != 0.0 for ref in sample["sequences"])


def completion_tokens(samples: Sequence[dict]) -> int:
    """The loss's normalizer: completion tokens of every sequence of the samples."""
    return sum(ref["length"] - ref["prompt_len"] for s in samples for ref in s["sequences"])


class Ranks(Protocol):
    """The data-parallel ranks of one step (forge_stream.trainer.distributed.DataParallel)."""

    def accumulate(self, model: torch.nn.Module, samples: Sequence[dict], config: StepConfig) -> dict:
        """`accumulate_gradients` of this rank's share of the batch, then the ranks' gradients summed into every
        rank's .grad; returns the whole batch's stats."""

    def agree(self, ok: bool) -> bool:
        """True on every rank iff `ok` is true on every rank."""


def sampling_settings(refs: Sequence[dict], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion token of the sequences (`lengths` tokens each), the temperature and top_p its recorded
    log-prob was computed at (`recorded_settings`: processed log-probs at the sampling settings, raw or greedy
    ones at temperature 1)."""
    settings = [recorded_settings(ref["temperature"], ref["top_p"], ref["logprobs_mode"]) for ref in refs]
    counts = torch.tensor(lengths)
    return (torch.tensor([t for t, _ in settings], dtype=torch.float64).repeat_interleave(counts),
            torch.tensor([p for _, p in settings], dtype=torch.float64).repeat_interleave(counts))


def accumulate_gradients(model: torch.nn.Module, samples: Sequence[dict], config: StepConfig,
                         loss_tokens: int | None = None, pad_to: int = 0,
                         progress: Callable[[str], None] | None = None) -> dict:
    """Run every micro-batch forward and backward (gradients add up in .grad); return the loss and counts.

    Only the samples with a signal (`has_signal`) run; the others count in the normalizer alone.
    `loss_tokens`: the normalizer (default: the samples' completion tokens); a rank of a data-parallel step passes
    the whole batch's. `pad_to`: run zero-weighted forward/backward passes until that many micro-batches ran (FSDP
    ranks must run the same number of passes, whose collectives pair up). `progress` hears a line after each
    micro-batch (its rows, the time so far): one long sample's step can take an hour on a CPU.
    """
    if loss_tokens is None:
        loss_tokens = completion_tokens(samples)
    batches = micro_batch_plan([s for s in samples if has_signal(s)], config.token_budget)
    loss_fn = cispo_loss if config.loss == "cispo" else partial(ppo_clip_loss, clip_ratio_c=config.clip_ratio_c)
    bounds = config.bounds
    total_loss = 0.0
    outs = []
    started, rows_total, rows_done = time.perf_counter(), sum(f.num_rows for f, _ in batches), 0
    for index, (forest, batch_refs) in enumerate(batches, 1):
        # Only the completion tokens' rows go through the LM head, each once per sampling setting, indexed once
        # into the sequences; each scored at the temperature and top_p its recorded log-probs were taken at.
        rows = [path[ref["prompt_len"]:] for path, ref in zip(forest.paths, batch_refs)]
        temperature, top_p = sampling_settings(batch_refs, [len(r) for r in rows])
        lp = path_logprobs(model, forest, torch.cat(rows), chunk_rows=config.chunk_rows,
                           checkpoint_layers=config.checkpoint_layers, temperature=temperature, top_p=top_p)
        out = loss_fn(
            lp.split([len(r) for r in rows]),
            [ref["old_logprobs"] for ref in batch_refs],
            [ref["advantage"] for ref in batch_refs],
            eps_low=bounds.low,
            eps_high=bounds.high,
            normalizer=max(loss_tokens, 1),
        )
        out.loss.backward()
        total_loss += float(out.loss.detach())
        outs.append(out)
        rows_done += forest.num_rows
        if progress:
            progress(f"micro-batch {index}/{len(batches)} done: {rows_done:,}/{rows_total:,} tree rows, "
                     f"{time.perf_counter() - started:.0f} s")
    for _ in range(len(batches), pad_to):
        idle = sequence_logprobs(model, pack([[0, 0]]), chunk_rows=config.chunk_rows)
        (idle[0].sum() * 0.0).backward()
    trained = sum(o.tokens for o in outs)
    tokens = max(trained, 1)
    return {
        "loss": total_loss,
        "loss_tokens": loss_tokens,
        "tokens": trained,
        "micro_batches": len(batches),
        "clip_fraction": sum(o.clip_fraction * o.tokens for o in outs) / tokens,
        "ratio_mean": sum(o.ratio_mean * o.tokens for o in outs) / tokens if trained else 1.0,
        "ratio_max": max((o.ratio_max for o in outs if o.tokens), default=1.0),
        "mismatch_mean": sum(o.mismatch_mean * o.tokens for o in outs) / tokens,
        "mismatch_max": max((o.mismatch_max for o in outs if o.tokens), default=0.0),
    }


def rollout_outcomes(samples: Sequence[dict]) -> list[float]:
    """One outcome reward per distinct (group, rollout) of the samples' sequences."""
    seen: dict[tuple[str, str], float] = {}
    for sample in samples:
        for ref in sample["sequences"]:
            seen.setdefault((sample["group_id"], ref["rollout"]), ref["outcome_reward"])
    return list(seen.values())


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[dict], config: StepConfig,
            ranks: Ranks | None, progress: Callable[[str], None] | None) -> tuple[dict, float]:
    """One optimizer update on the samples; a non-finite gradient leaves the weights as they were."""
    optimizer.zero_grad(set_to_none=True)
    if ranks is None:
        acc = accumulate_gradients(model, samples, config, progress=progress)
    else:
        acc = ranks.accumulate(model, samples, config)
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP
    finite = math.isfinite(grad_norm) if ranks is None else ranks.agree(math.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:  # a non-finite gradient would make every weight NaN: the step changes nothing and says so (grad_norm)
        optimizer.zero_grad(set_to_none=True)
    return acc, grad_norm


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[dict],
    config: StepConfig,
    policy_version: int,
    ranks: Ranks | None = None,
    progress: Callable[[str], None] | None = None,
) -> StepStats:
    """One optimizer step on the samples' trees; `policy_version` is the trainer's, for staleness.

    With `ranks`, every rank calls it with the same samples, trains its share, and takes the same step.

    `config.updates` > 1 reuses the batch: each further update recomputes the log-probs under the weights the
    last one moved, and the importance ratio against the recorded (sampling) log-probs, clipped by the loss's
    bounds, weighs it, as PPO's epochs and CISPO's off-policy updates do. The stats (loss, mismatch, ratios,
    grad norm) are the first update's: the distance between what was sampled and what trains.

    `progress` hears a line after each micro-batch (see `accumulate_gradients`; single-process steps only).
    """
    if not samples:
        raise ValueError("train_step needs at least one sample")
    if config.updates < 1:
        raise ValueError(f"updates must be at least 1, not {config.updates}")
    updates = [_update(model, optimizer, samples, config, ranks, progress) for _ in range(config.updates)]
    acc, grad_norm = updates[0]
    total = sum(ref["length"] for s in samples for ref in s["sequences"])
    unique = sum(len(s["token_ids"]) for s in samples)
    rewards = [ref["reward"] for s in samples for ref in s["sequences"]]
    staleness = [policy_version - s["policy_version"] for s in samples]
    outcomes = rollout_outcomes(samples)
    return StepStats(
        loss_name=config.loss,
        loss=acc["loss"],
        groups=len(samples),
        sequences=len(rewards),
        total_tokens=total,
        unique_tokens=unique,
        loss_tokens=acc["loss_tokens"],
        tree_ratio=total / unique,
        micro_batches=acc["micro_batches"],
        grad_norm=grad_norm,
        clip_fraction=acc["clip_fraction"],
        ratio_mean=acc["ratio_mean"],
        ratio_max=acc["ratio_max"],
        mismatch_mean=acc["mismatch_mean"],
        mismatch_max=acc["mismatch_max"],
        mean_reward=sum(rewards) / len(rewards),
        outcome_reward=sum(outcomes) / len(outcomes),
        rollouts=len(outcomes),
        staleness_mean=sum(staleness) / len(staleness),
        staleness_max=max(staleness),
        groups_without_signal=sum(not has_signal(s) for s in samples),
        per_update=[{key: grad if key == "grad_norm" else update[key] for key in UPDATE_STATS}
                    for update, grad in updates],
    )
