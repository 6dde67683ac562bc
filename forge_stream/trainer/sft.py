"""Warm start: supervised fine-tuning on the scripted teacher's demonstrations, through the tree-packed forward pass.

Each demonstration (forge_stream.tasks.teacher) is rendered turn by turn exactly as the engine sees it: the prompt
of assistant turn k is the model's chat template over the messages before it, with the suite's tools and the
generation prompt; the completion is the template's text of that assistant message up to and including
`<|im_end|>` (the engine's stop token), so tool calls are in the very format the engine's parser reads. A task's
turns share their prefixes, and all tasks share the system prompt and tools, so a whole batch is one prefix tree
and one `sequence_logprobs` call trains it. The loss is the mean negative log-likelihood of the assistant tokens only.

Training runs until a measured criterion, within a step budget (`max_steps`): every `check_every` steps, the
teacher-forced probability that the model, sampling at temperature 1 as the agent does, reproduces every assistant
token of a demonstration, averaged over `check_examples` demonstrations of the validation split (`held_out`). That
is the sampled reward the warm start would score if the teacher's way were the only right one (a lower bound:
another spelling of a tool call can also pass), so it is measured in the same unit as the held-out reward the
warm start must land in a band of, and it costs one forward pass without gradients (no generation, no engine):
cheap and deterministic on 2 CPU cores. Token accuracy would not do: a reply is right only if every token is, and
95% of tokens right is anything from 0 to 0.9 of replies. Training stops at the first check at or above `target`
where, with `family_target`, every task family's own criterion is at or above that as well: the overall mean can
reach its target through one easy family while another stays at its floor, where RL has nothing to reinforce.
A `ceiling` stops it anyway once the overall criterion reaches that (a warm start must stay below its band's top),
with `reached` false if a family is still short of its target.

With `balanced` (and `family_target`), half of each step's batch is drawn from the families still short of
`family_target` at the last check and half from every family (all of it from every family once none is short): a
hard family catches up while an easy one is trained only enough to keep what it has, instead of climbing towards
its ceiling, so every family starts RL with both a foothold and room to improve. Drawing only from the lagging
families was measured to be unstable: the predicted reward of the families left out collapsed within 25 steps.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.tasks.suite import TOOLS, make_tasks
from forge_stream.tasks.teacher import demonstration
from forge_stream.tree import pack, sequence_logprobs


@dataclass(frozen=True)
class SftSettings:
    base_model: Path
    out: Path
    examples: int = 600  # distinct training tasks demonstrated
    max_steps: int = 2000  # the budget: training stops earlier once the criterion reaches target
    target: float | None = 0.2  # held-out predicted reward to stop at (None: train max_steps)
    family_target: float | None = None  # with target: each family's held-out predicted reward must reach this too
    ceiling: float | None = None  # stop once the overall criterion reaches this, families at their target or not
    balanced: bool = False  # with family_target: half of each batch from the families still short of it
    check_every: int = 25  # steps between two measurements of the criterion
    check_examples: int = 128  # validation-split demonstrations the criterion is measured on
    batch_size: int = 16  # demonstrations per step
    lr: float = 2e-3
    seed: int = 0
    mix: dict[str, float] | None = None
    difficulty: int = 1


@dataclass(frozen=True)
class Turn:
    prompt_ids: list[int]
    completion_ids: list[int]


def render_turns(tokenizer, messages: list[dict], tools: list[dict] = TOOLS) -> list[Turn]:
    """Every assistant turn of a conversation as (prompt ids, completion ids), tokenized as the engine does."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    turns = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            messages[:i], tools=tools, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        full = tokenizer.encode(tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False),
                                add_special_tokens=False)
        if full[: len(prompt)] != prompt:
            raise ValueError("the chat template does not extend the prompt with the assistant turn")
        completion = full[len(prompt):]
        turns.append(Turn(prompt, completion[: completion.index(end) + 1]))
    return turns


def demonstrations(tokenizer, settings: SftSettings) -> tuple[list[list[Turn]], list[str]]:
    """Demonstrations of training-split tasks, and each one's task family."""
    tasks = make_tasks("train", settings.examples, seed=settings.seed, mix=settings.mix,
                       difficulty=settings.difficulty)
    return [render_turns(tokenizer, demonstration(t.graded, t.domain)) for t in tasks], [t.domain for t in tasks]


def held_out(tokenizer, settings: SftSettings) -> tuple[list[list[Turn]], list[str]]:
    """Demonstrations of validation-split tasks (disjoint by template from the training ones and from test), and
    each one's task family."""
    tasks = make_tasks("validation", settings.check_examples, seed=settings.seed, mix=settings.mix,
                       difficulty=settings.difficulty)
    return [render_turns(tokenizer, demonstration(t.graded, t.domain)) for t in tasks], [t.domain for t in tasks]


def criterion(model: torch.nn.Module, demos: list[list[Turn]], families: list[str] | None = None) -> dict:
    """`predicted_reward`: the mean over demonstrations of exp(sum of the log-probs of all their assistant tokens),
    the chance that sampling at temperature 1 reproduces each; `nll`: the mean NLL per assistant token;
    `by_family`: the predicted reward of each family's demonstrations (`families[i]` is demonstration i's)."""
    was_training = model.training
    model.eval()
    turns = [t for demo in demos for t in demo]
    with torch.no_grad():
        logprobs = sequence_logprobs(model, pack([t.prompt_ids + t.completion_ids for t in turns]))
    model.train(was_training)
    per_turn = iter([lp[len(t.prompt_ids) - 1:] for lp, t in zip(logprobs, turns)])
    per_demo = [torch.cat([next(per_turn) for _ in demo]) for demo in demos]
    tokens = torch.cat(per_demo)
    chances = [float(torch.exp(lp.sum())) for lp in per_demo]
    by_family: dict[str, list[float]] = {}
    for family, chance in zip(families or [], chances):
        by_family.setdefault(family, []).append(chance)
    return {"predicted_reward": sum(chances) / len(chances), "nll": float(-tokens.mean()),
            "by_family": {f: sum(c) / len(c) for f, c in sorted(by_family.items())}}


def reached(measured: dict, settings: SftSettings) -> bool:
    """Whether the criterion is at its target (and every family at `family_target`, if set)."""
    return (settings.target is not None and measured["predicted_reward"] >= settings.target
            and (settings.family_target is None
                 or min(measured.get("by_family", {}).values(), default=0.0) >= settings.family_target))


def lagging(measured: dict, settings: SftSettings) -> set[str]:
    """The families a balanced warm start trains next: those short of `family_target` (empty: all of them)."""
    if not settings.balanced or settings.family_target is None:
        return set()
    return {f for f, v in measured.get("by_family", {}).items() if v < settings.family_target}


def draw_batch(rng: random.Random, demos: list[list[Turn]], families: list[str], focus: set[str],
               size: int) -> list[list[Turn]]:
    """One step's demonstrations: half from the `focus` families, the rest from all (all of it with no focus)."""
    focused = [d for d, f in zip(demos, families) if f in focus]
    half = min(size // 2, len(focused)) if focused else 0
    return rng.sample(focused, half) + rng.sample(demos, min(size - half, len(demos)))


def sft_loss(model: torch.nn.Module, batch: list[list[Turn]]) -> torch.Tensor:
    """Mean NLL of the assistant tokens of a batch of demonstrations, one forest forward pass."""
    turns = [t for demo in batch for t in demo]
    logprobs = sequence_logprobs(model, pack([t.prompt_ids + t.completion_ids for t in turns]))
    completion = torch.cat([lp[len(t.prompt_ids) - 1:] for lp, t in zip(logprobs, turns)])
    return -completion.mean()


def run_sft(settings: SftSettings, progress: Callable[[str], None] = print) -> dict:
    """Train the base model on the demonstrations until the held-out criterion reaches `settings.target` (or for
    `settings.max_steps`), and save it (with its tokenizer) to `settings.out`."""
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(settings.base_model)
    model = AutoModelForCausalLM.from_pretrained(settings.base_model)
    model.train()
    (demos, demo_families), (checks, families) = demonstrations(tokenizer, settings), held_out(tokenizer, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    rng = random.Random(settings.seed)
    started, loss, step, measured = time.perf_counter(), float("nan"), 0, criterion(model, checks, families)
    curve, focus = [{"step": 0, **measured}], lagging(measured, settings)
    while step < settings.max_steps and (settings.target is None or not reached(measured, settings)) and (
            settings.ceiling is None or measured["predicted_reward"] < settings.ceiling):
        batch = draw_batch(rng, demos, demo_families, focus, settings.batch_size)
        optimizer.zero_grad(set_to_none=True)
        value = sft_loss(model, batch)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss, step = float(value.detach()), step + 1
        if step % settings.check_every == 0 or step == settings.max_steps:
            measured = criterion(model, checks, families)
            curve.append({"step": step, **measured})
            families_text = ", ".join(f"{f} {v:.3f}" for f, v in measured["by_family"].items())
            wanted = f"target {settings.target}" + (f", each family {settings.family_target}"
                                                     if settings.family_target is not None else "")
            focus = lagging(measured, settings)
            if focus and focus != set(measured["by_family"]):
                wanted += f"; next: half of each batch from {', '.join(sorted(focus))}"
            progress(f"sft step {step}/{settings.max_steps}: loss {loss:.4f}, held-out predicted reward "
                     f"{measured['predicted_reward']:.3f} ({families_text}; {wanted}), held-out nll "
                     f"{measured['nll']:.4f} ({time.perf_counter() - started:.0f}s)")
    settings.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(settings.out, safe_serialization=True)
    tokenizer.save_pretrained(settings.out)
    return {"out": str(settings.out), "steps": step, "max_steps": settings.max_steps, "target": settings.target,
            "family_target": settings.family_target, "ceiling": settings.ceiling, "balanced": settings.balanced,
            "reached": reached(measured, settings),
            "predicted_reward": measured["predicted_reward"], "by_family": measured["by_family"],
            "heldout_nll": measured["nll"],
            "heldout_examples": len(checks), "examples": len(demos), "final_loss": loss, "curve": curve,
            "seconds": round(time.perf_counter() - started, 1)}
