"""Warm start: supervised fine-tuning on the scripted teacher's demonstrations, through the tree-packed forward pass.

Each demonstration (forge_stream.tasks.teacher) is rendered turn by turn exactly as the engine sees it: the prompt
of assistant turn k is the model's chat template over the messages before it, with the suite's tools and the
generation prompt; the completion is the template's text of that assistant message up to and including
`<|im_end|>` (the engine's stop token), so tool calls are in the very format the engine's parser reads. A task's
turns share their prefixes, and all tasks share the system prompt and tools, so a whole batch is one prefix tree
and one `sequence_logprobs` call trains it. The loss is the mean negative log-likelihood of the assistant tokens only.
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
    steps: int = 600  # past the jump where copying digits is learned (about step 300), settled
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


def demonstrations(tokenizer, settings: SftSettings) -> list[list[Turn]]:
    tasks = make_tasks("train", settings.examples, seed=settings.seed, mix=settings.mix,
                       difficulty=settings.difficulty)
    return [render_turns(tokenizer, demonstration(t.graded, t.domain)) for t in tasks]


def sft_loss(model: torch.nn.Module, batch: list[list[Turn]]) -> torch.Tensor:
    """Mean NLL of the assistant tokens of a batch of demonstrations, one forest forward pass."""
    turns = [t for demo in batch for t in demo]
    logprobs = sequence_logprobs(model, pack([t.prompt_ids + t.completion_ids for t in turns]))
    completion = torch.cat([lp[len(t.prompt_ids) - 1:] for lp, t in zip(logprobs, turns)])
    return -completion.mean()


def run_sft(settings: SftSettings, progress: Callable[[str], None] = print) -> dict:
    """Train the base model on the demonstrations and save it (with its tokenizer) to `settings.out`."""
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(settings.base_model)
    model = AutoModelForCausalLM.from_pretrained(settings.base_model)
    model.train()
    demos = demonstrations(tokenizer, settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr)
    rng = random.Random(settings.seed)
    started, loss = time.perf_counter(), float("nan")
    for step in range(settings.steps):
        batch = rng.sample(demos, min(settings.batch_size, len(demos)))
        optimizer.zero_grad(set_to_none=True)
        value = sft_loss(model, batch)
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss = float(value.detach())
        if step % 25 == 0 or step == settings.steps - 1:
            progress(f"sft step {step + 1}/{settings.steps}: loss {loss:.4f} ({time.perf_counter() - started:.0f}s)")
    settings.out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(settings.out, safe_serialization=True)
    tokenizer.save_pretrained(settings.out)
    return {"out": str(settings.out), "steps": settings.steps, "examples": len(demos), "final_loss": loss,
            "seconds": round(time.perf_counter() - started, 1)}
