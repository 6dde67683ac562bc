"""`forge-stream tasks generate`: write tasks of the shipped suite (its train, validation or test split) as JSONL."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(no_args_is_help=True, help="The shipped task suite.")


@app.callback()
def group() -> None:
    """The shipped task suite."""


@app.command("generate")
def generate(
    split: str = typer.Option("train", help="train, validation or test (heldout: test); disjoint by template."),
    n: int = typer.Option(100, help="How many tasks."),
    seed: int = typer.Option(0, help="Seed of the stream."),
    mix: Optional[str] = typer.Option(None, help="Domain weights, e.g. 'reasoning=1,agent=1,lookup=1'."),
    difficulty: int = typer.Option(1, help="Task difficulty."),
    group_size: int = typer.Option(8, help="Rollouts per task (G)."),
    out: Optional[Path] = typer.Option(None, help="Output file (default: stdout)."),
) -> None:
    """Seeded tasks of the suite, one JSON object a line (what `rollout run --tasks` and `eval --tasks` read)."""
    from forge_stream.tasks.suite import make_tasks, parse_mix, to_jsonl

    text = to_jsonl(make_tasks(split, n, seed, parse_mix(mix), difficulty, group_size))
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text)
        typer.echo(f"wrote {n} {split} tasks to {out}", err=True)


@app.command("probe")
def probe_command(
    model: Optional[Path] = typer.Option(None, help="Policy (HF directory); default: the demo model of FORGE_HOME."),
    n: int = typer.Option(150, help="Test tasks."),
    seed: int = typer.Option(0, help="Seed of the test stream."),
    mix: Optional[str] = typer.Option(None, help="Domain weights, e.g. 'reasoning=1,agent=2,lookup=1'."),
    difficulty: int = typer.Option(1, help="Task difficulty."),
    by_kind: bool = typer.Option(False, "--by-kind", help="Per kind of task (a lookup key, an agent operator and "
                                 "answer length, a reasoning template) instead of per domain."),
) -> None:
    """Teacher-forced: per domain (or kind of task) and turn, how likely the policy produces the ideal turn, and its
    worst tokens (forge_stream/trainer/teacher_forced.py)."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge_stream.cli.options import settings
    from forge_stream.tasks.suite import parse_mix
    from forge_stream.trainer.teacher_forced import score_ideal_turns

    path = model or settings(None).model_dir
    report = score_ideal_turns(AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), n,
                               seed, parse_mix(mix), difficulty, by_kind=by_kind)
    typer.echo(json.dumps(report, indent=1))
