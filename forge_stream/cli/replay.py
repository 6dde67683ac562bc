"""`forge-stream replay`: re-train from historical topics between two timestamps or offsets, as a separate run."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, JsonOption, settings
from forge_stream.startup import reach_kafka


def to_ms(text: Optional[str]) -> Optional[int]:
    """Epoch milliseconds, or an ISO-8601 time (`2026-11-29T10:00:00+00:00`)."""
    if text is None:
        return None
    return int(text) if text.isdigit() else int(datetime.fromisoformat(text).timestamp() * 1000)


def offsets(text: Optional[str]) -> Optional[dict[int, int]]:
    """`0:120,1:98`: partition:offset pairs."""
    if text is None:
        return None
    return {int(p): int(o) for p, o in (pair.split(":") for pair in text.split(","))}


def replay(
    run: str = typer.Option(..., help="The replay's own run name (not the live run's)."),
    start: Optional[str] = typer.Option(None, "--from", help="Start time: epoch ms or ISO-8601."),
    end: Optional[str] = typer.Option(None, "--to", help="End time (exclusive): epoch ms or ISO-8601."),
    from_offsets: Optional[str] = typer.Option(None, help="Start offsets of forge.samples, e.g. 0:120,1:98."),
    to_offsets: Optional[str] = typer.Option(None, help="End offsets (exclusive), e.g. 0:500,1:480."),
    model: Optional[Path] = typer.Option(None, help="Initial policy (default: the tiny demo model)."),
    checkpoint_dir: Optional[Path] = typer.Option(None, help="Default: $FORGE_HOME/checkpoints/<run>."),
    batch_size: int = typer.Option(8, help="Groups per optimizer step."),
    lr: float = typer.Option(1e-5, help="AdamW learning rate."),
    loss: str = typer.Option("cispo", help="cispo or ppo."),
    eps_low: Optional[float] = typer.Option(None, help="Ratio clip 1 - eps_low (default: the loss's own)."),
    eps_high: Optional[float] = typer.Option(None, help="Ratio clip 1 + eps_high (default: the loss's own)."),
    clip_ratio_c: float = typer.Option(3.0, help="PPO's dual clip (verl's clip_ratio_c): with a negative "
                                                 "advantage a token's ratio counts at most this much; 0 turns it off."),
    bootstrap_servers: Optional[str] = BootstrapOption,
    as_json: bool = JsonOption,
) -> None:
    """Re-train from forge.samples history without touching live consumer offsets."""
    cfg = settings(bootstrap_servers)
    reach_kafka(cfg)
    from forge_stream.kafka.history import Slice
    from forge_stream.trainer.replay import ReplaySettings
    from forge_stream.trainer.replay import replay as run_replay
    from forge_stream.trainer.step import StepConfig, clip_for

    where = Slice(to_ms(start), to_ms(end), offsets(from_offsets), offsets(to_offsets))
    result = run_replay(ReplaySettings(cfg.bootstrap, model or cfg.model_dir, checkpoint_dir or cfg.checkpoint_dir / run,
                                       run, where, batch_size,
                                       StepConfig(loss=loss, clip=clip_for(loss, eps_low, eps_high),
                                                  clip_ratio_c=clip_ratio_c or None, lr=lr)),
                        progress=lambda line: typer.echo(line, err=True))
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"replayed {result['samples']} groups in {len(result['steps'])} steps as run {run}; "
                   f"policy v{result['final_policy_version']}")
