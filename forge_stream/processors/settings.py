"""The processors' one frozen settings object: reward rules, discount, advantage mode, timeouts. Built at the
entry point."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

AdvantageMode = Literal["rollout", "turn"]
AdvantageScale = Literal["std", "none"]


class RuleSpec(BaseModel):
    """A process-reward rule: a plain function named by dotted path, and the weight its value is scaled by."""

    model_config = ConfigDict(frozen=True)

    path: str
    weight: float = 1.0

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


def parse_rule(text: str) -> RuleSpec:
    """'package.module.function=WEIGHT' (weight 1 when omitted); the rule must import.

    >>> parse_rule("forge_stream.processors.rules.tool_result_answers=0.5")
    RuleSpec(path='forge_stream.processors.rules.tool_result_answers', weight=0.5)
    """
    from forge_stream.processors.rules import load_rule

    path, _, weight = text.partition("=")
    spec = RuleSpec(path=path.strip(), weight=float(weight) if weight else 1.0)
    load_rule(spec.path)  # ImportError / AttributeError naming the path, at start-up rather than per group
    return spec


DEFAULT_RULES = (
    RuleSpec(path="forge_stream.processors.rules.invalid_tool_call", weight=0.2),
    RuleSpec(path="forge_stream.processors.rules.tool_error", weight=0.1),
    RuleSpec(path="forge_stream.processors.rules.language_mixing", weight=0.1),
)


class ProcessorSettings(BaseModel):
    """How a group becomes a training sample (DESIGN sections 5 and 8)."""

    model_config = ConfigDict(frozen=True)

    gamma: float = 1.0  # reward-to-go discount ("turn" advantages)
    # "rollout": GRPO, each rollout's return normalized over the group's rollouts, shared by all its turns;
    # "turn": each turn's reward-to-go normalized over all turns of the group (forge_stream.processors.rewards)
    advantage: AdvantageMode = "rollout"
    # "std": divide by the group's std (GRPO); "none": only subtract the group's mean (Dr. GRPO). See rewards.py.
    advantage_scale: AdvantageScale = "none"
    rules: tuple[RuleSpec, ...] = DEFAULT_RULES
    # the time reward lies in [-weight, +weight]; opt-in (0: off): wall time on shared, busy cores is mostly noise,
    # and in a group whose outcomes are all equal it would be the group's only signal
    time_reward_weight: float = 0.0
    success_threshold: float = 0.5  # a rollout is successful when its outcome reward is at least this
    missing_outcome_reward: float = 0.0  # outcome of a session that failed (status != ok) without a grade
    # an open group with no event for this long (its last event's time against wall time) is cut: idle, not old
    group_timeout_ms: int = 600_000
    # an open group that holds more than this is cut at once (forge_stream.processors.groups.over_size): its size is
    # bounded, not its length in time; tokens count prompt ids as recorded plus completion ids
    group_max_completions: int = 4096
    group_max_tokens: int = 4_000_000
    forget_closed_ms: int = 3_600_000  # how long a closed group's marker is kept (late events are ignored)
    source: str = "processors"  # the `source` of the rewards we publish; such rewards are never re-read
