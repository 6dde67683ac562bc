"""`forge-stream processors run`: the processors topology (faust worker) as a long-running process."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from forge_stream.cli.options import BootstrapOption, settings
from forge_stream.startup import WaitForKafkaOption, ready_kafka

app = typer.Typer(no_args_is_help=True, help="Stream processors: events -> trajectories, rewards, samples.")


@app.command("run")
def run(
    bootstrap_servers: Optional[str] = BootstrapOption,
    data_dir: Optional[Path] = typer.Option(None, help="Worker state directory (default: FORGE_HOME/processors)."),
    app_id: str = typer.Option("forge-processors", help="Names the consumer group, changelog and internal topics."),
    group_timeout_s: float = typer.Option(600.0, help="Cut an open group that has had no event for this long (idle, "
                                                      "whatever its age)."),
    group_max_completions: int = typer.Option(4096, help="Cut an open group holding more completions than this."),
    group_max_tokens: int = typer.Option(4_000_000, help="Cut an open group whose completions hold more token ids "
                                                         "than this (prompt ids as recorded plus completion ids)."),
    gamma: float = typer.Option(1.0, help="Reward-to-go discount (turn advantages)."),
    advantage: str = typer.Option("rollout", help="rollout: GRPO, each rollout's return normalized over the "
                                                  "group's rollouts; turn: reward-to-go normalized over all turns."),
    advantage_scale: str = typer.Option("none", help="std: divide by the group's std (GRPO); none: only subtract "
                                                    "the group's mean (Dr. GRPO)."),
    time_reward_weight: float = typer.Option(0.0, help="Weight w of the completion-time reward (faster successful "
                                                       "rollouts of a group earn up to +w, slower ones down to -w). "
                                                       "Off by default: wall time on busy cores is mostly noise."),
    rule: list[str] = typer.Option([], help="A process-reward rule PATH=WEIGHT (package.module.function), added to "
                                            "the defaults (invalid_tool_call, tool_error, language_mixing); e.g. "
                                            "forge_stream.processors.rules.tool_result_answers=0.5. Repeatable."),
    tick_s: float = typer.Option(1.0, help="How often open groups are checked for their deadline."),
    claim_store: Optional[str] = typer.Option(None, help="fsspec URL where TrainSamples too large for one Kafka "
                                                          "record are stored (claim check; default: DATA_DIR/claims, "
                                                          "one host). A cluster needs a store the trainers reach, "
                                                          "e.g. s3://bucket/prefix (pip install s3fs)."),
    claim_over_bytes: int = typer.Option(1024 * 1024, help="A TrainSample encoded larger than this goes as a "
                                                           "SampleClaim (by reference)."),
    offset_reset: str = typer.Option("earliest", help="Where a new consumer group starts: earliest or latest."),
    loglevel: str = typer.Option("info", "--loglevel", "-l"),
    wait_for_kafka: bool = WaitForKafkaOption,
) -> None:
    """Run the processors worker until stopped."""
    from forge_stream.processors import ProcessorSettings
    from forge_stream.processors.settings import DEFAULT_RULES, parse_rule
    from topologies.processors import TopologyConfig, run_worker

    forge = settings(bootstrap_servers)
    ready_kafka(forge, wait=wait_for_kafka)
    config = TopologyConfig(
        bootstrap=forge.bootstrap, data_dir=data_dir or forge.home / "processors", app_id=app_id,
        processors=ProcessorSettings(group_timeout_ms=int(group_timeout_s * 1000), gamma=gamma,
                                     group_max_completions=group_max_completions, group_max_tokens=group_max_tokens,
                                     advantage=advantage, advantage_scale=advantage_scale,
                                     time_reward_weight=time_reward_weight,
                                     rules=DEFAULT_RULES + tuple(parse_rule(r) for r in rule)),
        tick_s=tick_s, offset_reset=offset_reset, replication=forge.replication,
        claim_store=claim_store, claim_over_bytes=claim_over_bytes,
    )
    run_worker(config, loglevel)
