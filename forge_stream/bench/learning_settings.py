"""`LearningSettings`: what one `forge-stream bench learning` run is (its model, training, evaluation and bootstrap
settings) and the task sources it trains and evaluates on. forge_stream.bench.learning runs it;
forge_stream.bench.learning_result reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LearningSettings:
    rl_minutes: float = 15.0
    engine: str = "torch"  # "vllm": real vLLM (`engine vllm`), "torch": the local torch engine
    engine_load_interval: float = 0.0  # vLLM: seconds from one weight load to the next (engine vllm --load-interval)
    lora_rank: int = 0  # > 0: the trainer trains a LoRA adapter of this rank, the engine serves each as a version
    engines: int = 1  # engine replicas behind the gateway (up --engines)
    kv_tier: str | None = None  # "lmcache": the shared KV tier under the vLLM engines (up --kv-tier)
    loss: str = "cispo"
    lr: float = 1e-4
    updates_per_batch: int = 4  # optimizer updates per batch (sample reuse; the trainer is otherwise mostly idle)
    subgoal_reward: float = 0.0  # weight of the tool_result_answers process rule (0: off)
    partial_credit: float = 0.0  # weight of the answer_prefix process rule (0: off)
    advantage_scale: str = "none"  # "std" (GRPO) or "none" (Dr. GRPO): see forge_stream/processors/rewards.py
    batch_size: int = 16  # groups per optimizer step
    group_size: int = 8  # G rollouts per task
    replay_edge: float = 0.0  # share of groups re-running a task whose group had a signal (rollout controller)
    concurrency: int = 64  # sessions in flight
    agent_workers: int = 2
    test_tasks: int = 600  # +-0.040 at a mean of 0.5 (module docstring)
    mix: str = "reasoning=1,agent=1,lookup=1"
    seed: int = 0  # the first seed
    seeds: int = 1  # seeds seed, seed + 1, ...: each its own model init, warm start, task stream and RL run
    sft_max_steps: int = 3000
    sft_target: float = 0.2  # held-out predicted reward at which SFT stops (forge_stream/trainer/sft.py)
    sft_family_target: float | None = 0.1  # and each task family's own (None: off)
    sft_balanced: bool = True  # half of each batch from the families short of sft_family_target
    sft_examples: int = 600
    sft_lr: float = 3e-3
    sft_batch_size: int = 16  # demonstrations per SFT step
    sft_check_every: int = 25  # SFT steps between two measurements of its criterion
    sft_check_examples: int = 128  # validation demonstrations the criterion is measured on
    hidden_size: int = 128  # the tiny model's width and depth (`model init --hidden-size --layers`)
    layers: int = 2
    band: tuple[float, float] = (0.1, 0.5)  # held-out reward a warm start must land in before RL starts
    allow_outside_band: bool = False
    bootstrap_replicates: int = 2000
    bootstrap: str | None = None  # an external cluster; default: each seed's own broker
    home: Path | None = None  # default: a fresh temporary directory, removed afterwards
    plot: Path | None = None  # draw the reward curve here before tearing down (one file per seed with several)
    model: str | None = None  # a pretrained model (directory or known name) to start from instead of the tiny model
    pretrained_sft: bool = False  # with `model`: warm-start it with SFT on the mix's demonstrations first
    warm_from: Path | None = None  # an earlier run's result (--json, its home kept): each seed starts from its warm start
    eval_split: str = "test"  # "validation" to choose settings: the test split is for reporting only
    temperature: float | None = None  # what the agent samples at, training and evaluation alike (None: its default, 1)

    def __post_init__(self):
        if self.eval_split not in ("test", "validation"):
            raise ValueError(f"the evaluation split is test or validation, not {self.eval_split!r}")

    @property
    def test_source(self) -> str:
        """The evaluation's tasks: the suite's test split (or validation, to choose settings), the same whatever
        the mix for the tiny model; of the mix's families for a pretrained model."""
        source = f"suite:{self.eval_split}?mix={self.mix}" if self.model else f"suite:{self.eval_split}"
        return source + self._sampling(first="&" if self.model else "?")

    def training_source(self, seed: int) -> str:
        """Seed `seed`'s RL stream. It starts past the tasks the seed's warm start was shown (`sft --examples N` on
        the same seed and mix demonstrates the stream's first N), so RL does not begin on memorized tasks.

        >>> LearningSettings().training_source(2)
        'suite:train?seed=2&mix=reasoning=1,agent=1,lookup=1&skip=600'
        """
        skip = 0 if self.model and not self.pretrained_sft else self.sft_examples
        return f"suite:train?seed={seed}&mix={self.mix}" + (f"&skip={skip}" if skip else "") + self._sampling()

    def _sampling(self, first: str = "&") -> str:
        return "" if self.temperature is None else f"{first}temperature={self.temperature:g}"
