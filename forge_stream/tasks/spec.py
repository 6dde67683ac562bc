"""`TaskSpec`: one task as the rollout controller, the evaluator, the graders and the task suite know it.

It sits under forge_stream.tasks, below both the rollout side (forge_stream.rollout.sources reads tasks into it) and
the suite (forge_stream.tasks.suite makes them), so neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TaskSpec:
    """One task. The agent gets `prompt` alone (what it needs to act, e.g. {"question": ...}); the grader gets
    `prompt` with `reference` laid over it (what only the grader may see, e.g. {"answer": ...}), so a black-box
    agent cannot print the answer it was handed."""

    task_id: str
    prompt: dict  # free-form payload for the agent (and the grader)
    domain: str = "agent"
    grader: str = "exact_match"
    group_size: int = 4
    metadata: dict[str, str] = field(default_factory=dict)
    reference: dict = field(default_factory=dict)  # for the grader only

    @property
    def graded(self) -> dict:
        """The task as its grader sees it: the prompt and the reference."""
        return {**self.prompt, **self.reference}

    @classmethod
    def from_json(cls, raw: dict) -> "TaskSpec":
        return cls(raw["task_id"], raw["prompt"], raw.get("domain", "agent"), raw.get("grader", "exact_match"),
                   int(raw.get("group_size", 4)), {k: str(v) for k, v in raw.get("metadata", {}).items()},
                   dict(raw.get("reference") or {}))
