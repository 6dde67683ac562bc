"""`forge-stream train`: the trainer process (windowed FIFO consumer + tree-packed CISPO or PPO + policy publishing);
`--nproc N` runs it as N torch.distributed ranks under torchrun (forge_stream.trainer.distributed)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings
from forge_stream.startup import WaitForKafkaOption, ready_kafka


def parse_window(text: str):
    """`0.3` (a fraction of the rollout slots or queue), `64` (a count) or `greedy`."""
    from forge_stream.scheduler.window import WindowSpec

    if text == "greedy":
        return WindowSpec(greedy=True)
    value = float(text)
    if value >= 1 and value.is_integer():
        return WindowSpec(count=int(value))
    return WindowSpec(fraction=value)


def train(
    bootstrap_servers: Optional[str] = BootstrapOption,
    model: Optional[Path] = typer.Option(None, help="Initial policy (HF directory); default: the tiny demo model."),
    checkpoint_dir: Optional[Path] = typer.Option(None, help="Where checkpoints go (default: $FORGE_HOME/checkpoints)."),
    run: str = typer.Option("default", help="Run name: names the consumer group and keys forge.train_metrics."),
    steps: Optional[int] = typer.Option(None, help="Stop after this many steps (default: run until killed)."),
    batch_size: int = typer.Option(8, help="Groups per optimizer step."),
    window: str = typer.Option("0.3", help="Windowed FIFO: a fraction, a count, or 'greedy'."),
    rollout_slots: Optional[int] = typer.Option(None, help="Basis of a fractional window (default: the queue)."),
    group_timeout: float = typer.Option(900.0, help="Backstop: skip the group blocking the window once it has had "
                                                    "no event for this many seconds (idle, whatever its age; its "
                                                    "sessions, completions, tool spans and rewards count). Keep it "
                                                    "above the processors' --group-timeout-s, which cut an idle "
                                                    "group first."),
    max_staleness: Optional[int] = typer.Option(None, help="Bound on trainer version minus sample version."),
    stale_action: str = typer.Option("keep", help="keep (and count) or drop (and record) samples over the bound."),
    loss: str = typer.Option("cispo", help="cispo or ppo."),
    lr: float = typer.Option(1e-5, help="AdamW learning rate."),
    eps_low: Optional[float] = typer.Option(None, help="Ratio clip 1 - eps_low (default: the loss's own: "
                                                        "CISPO none, PPO 0.2)."),
    eps_high: Optional[float] = typer.Option(None, help="Ratio clip 1 + eps_high (default: the loss's own: "
                                                         "CISPO 4.0, PPO 0.2)."),
    clip_ratio_c: float = typer.Option(3.0, help="PPO's dual clip (verl's clip_ratio_c): with a negative "
                                                 "advantage a token's ratio counts at most this much; 0 turns it off."),
    token_budget: int = typer.Option(16384, help="Most unique tree rows per forward pass."),
    updates_per_batch: int = typer.Option(1, help="Optimizer updates per batch (sample reuse, like PPO's epochs; "
                                                  "the clipped importance ratio weighs the later ones)."),
    wait_s: float = typer.Option(5.0, help="Train a partial batch after waiting this long for a full one."),
    from_now: bool = typer.Option(False, help="A new run trains only on tasks submitted from now on."),
    nproc: int = typer.Option(1, help="Data-parallel ranks on this machine (torchrun; gloo on CPU, NCCL with one "
                                      "GPU per rank)."),
    fsdp: bool = typer.Option(False, help="Shard the model over the ranks with FSDP (GPU only)."),
    nnodes: int = typer.Option(1, help="Machines taking part (each runs this command with its --node-rank)."),
    node_rank: int = typer.Option(0, help="This machine's index among --nnodes (0 consumes from Kafka)."),
    master_addr: Optional[str] = typer.Option(None, help="HOST:PORT of node 0's rendezvous (with --nnodes > 1)."),
    wait_for_kafka: bool = WaitForKafkaOption,
    lora_rank: int = typer.Option(0, help="Train a LoRA adapter of this rank on every linear layer but the LM head "
                                          "(peft) instead of every weight; each version is the adapter (MBs). "
                                          "LoRA wants about 10x full fine-tuning's --lr. 0: full fine-tuning."),
    lora_alpha: Optional[float] = typer.Option(None, help="The LoRA adapter's alpha (scale alpha / rank); default "
                                                          "2 x --lora-rank."),
) -> None:
    """Consume TrainSamples in windowed FIFO order, train, and publish each new policy version."""
    import torch.distributed

    from forge_stream.scheduler.consumer import SchedulerSettings
    from forge_stream.scheduler.report import view_file
    from forge_stream.trainer import distributed
    from forge_stream.trainer.service import TrainerSettings, run_trainer
    from forge_stream.trainer.step import StepConfig, clip_for

    if (nproc > 1 or fsdp or nnodes > 1) and not distributed.under_torchrun():
        if nnodes > 1 and not master_addr:
            raise typer.BadParameter("--nnodes > 1 needs --master-addr HOST:PORT (node 0's rendezvous)")
        raise typer.Exit(distributed.launch(nproc, sys.argv[1:], nnodes, node_rank, master_addr))
    ranks = distributed.from_env(fsdp) if distributed.under_torchrun() else None
    rank = "" if ranks is None else f"rank {ranks.rank} "
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s")
    cfg = settings(bootstrap_servers)
    if ranks is None or ranks.is_main:
        ready_kafka(cfg, wait=wait_for_kafka)
    scheduler = SchedulerSettings(bootstrap=cfg.bootstrap, run=run, batch_size=batch_size,
                                  window=parse_window(window), rollout_slots=rollout_slots,
                                  group_timeout_s=group_timeout, max_staleness=max_staleness,
                                  stale_action=stale_action, view_path=view_file(cfg.run_dir, run))
    trainer = TrainerSettings(bootstrap=cfg.bootstrap, base_model=model or cfg.model_dir,
                              checkpoint_dir=checkpoint_dir or cfg.checkpoint_dir / run, scheduler=scheduler,
                              step=StepConfig(loss=loss, clip=clip_for(loss, eps_low, eps_high),
                                              clip_ratio_c=clip_ratio_c or None, lr=lr,
                                              token_budget=token_budget, updates=updates_per_batch),
                              wait_s=wait_s, from_now=from_now, lora_rank=lora_rank, lora_alpha=lora_alpha)
    try:
        run_trainer(trainer, steps, progress=lambda line: typer.echo(line, err=True), ranks=ranks)
    finally:
        if ranks is not None:
            torch.distributed.destroy_process_group()
