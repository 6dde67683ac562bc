"""`forge-stream sft`: warm-start a model on the scripted teacher's demonstrations of the shipped task suite."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.bench import emit
from forge_stream.cli.options import JsonOption


def sft(
    out: Path = typer.Option(..., help="Directory to write the warm-started model to."),
    model: Optional[Path] = typer.Option(None, help="Base model (HF directory); default: a fresh tiny model."),
    examples: int = typer.Option(600, help="Distinct training tasks demonstrated."),
    max_steps: int = typer.Option(2000, help="Step budget: SFT stops here if the criterion has not reached --target."),
    target: float = typer.Option(0.2, help="Stop at the first check where the held-out predicted reward (the "
                                           "teacher-forced chance of sampling a validation demonstration's every "
                                           "assistant token) reaches this; a negative value: train --max-steps."),
    family_target: float = typer.Option(-1.0, help="With --target: SFT also goes on until every task family's own "
                                                    "held-out predicted reward reaches this; negative: off."),
    ceiling: float = typer.Option(-1.0, help="Stop once the held-out predicted reward reaches this, every family at "
                                             "--family-target or not (a warm start's band has a top); negative: off."),
    balanced: bool = typer.Option(False, help="With --family-target: draw half of each batch from the families "
                                              "still short of it, the rest from all, so an easy one keeps room to "
                                              "improve."),
    check_every: int = typer.Option(25, help="Steps between two measurements of the criterion."),
    check_examples: int = typer.Option(128, help="Validation-split demonstrations the criterion is measured on."),
    batch_size: int = typer.Option(16, help="Demonstrations per step."),
    lr: float = typer.Option(2e-3, help="AdamW learning rate."),
    seed: int = typer.Option(0, help="Seed of the demonstrations and the batches."),
    mix: Optional[str] = typer.Option(None, help="Domain weights, e.g. 'reasoning=1,agent=1,lookup=1'."),
    difficulty: int = typer.Option(1, help="Task difficulty."),
    as_json: bool = JsonOption,
) -> None:
    """Supervised fine-tuning on teacher demonstrations (assistant tokens only, tree-packed forward pass), until a
    held-out criterion reaches --target or for at most --max-steps steps."""
    from forge_stream.tasks.suite import parse_mix
    from forge_stream.trainer.sft import SftSettings, run_sft

    base = model
    if base is None:
        from forge_stream.tiny.model import TinyModelSpec, init_tiny_model

        base = out.with_name(out.name + "-init")
        init_tiny_model(base, TinyModelSpec(seed=seed))
    result = run_sft(SftSettings(base_model=base, out=out, examples=examples, max_steps=max_steps,
                                 target=None if target < 0 else target,
                                 family_target=None if family_target < 0 else family_target,
                                 ceiling=None if ceiling < 0 else ceiling, balanced=balanced, check_every=check_every,
                                 check_examples=check_examples, batch_size=batch_size, lr=lr, seed=seed,
                                 mix=parse_mix(mix), difficulty=difficulty),
                     progress=lambda line: typer.echo(line, err=True))
    emit(result, as_json)
