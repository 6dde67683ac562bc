"""The topic catalog: every Kafka topic forge-stream uses, with its key, value schemas, layout and owners.

Nobody spells a topic name elsewhere: code says `TOPICS.completions.name`. `forge-stream topics create` makes
them all (idempotently) with these settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FOREVER = -1
DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class Topic:
    name: str
    key: str  # what the record key holds
    value_schemas: tuple[str, ...]  # Avro record names allowed as values
    partitions: int
    retention_ms: int
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    cleanup_policy: str = "delete"
    doc: str = ""
    extra_config: dict[str, str] = field(default_factory=dict)

    def config(self) -> dict[str, str]:
        return {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            "message.timestamp.type": "CreateTime",
            **self.extra_config,
        }


@dataclass(frozen=True)
class Catalog:
    tasks: Topic
    sessions: Topic
    completions: Topic
    tool_spans: Topic
    rewards: Topic
    trajectories: Topic
    samples: Topic
    policy: Topic
    train_metrics: Topic
    evals: Topic
    dlq: Topic

    def all(self) -> list[Topic]:
        return [getattr(self, name) for name in self.__dataclass_fields__]

    def by_name(self, name: str) -> Topic:
        for topic in self.all():
            if topic.name == name:
                return topic
        raise KeyError(f"{name!r} is not a forge-stream topic; see `forge-stream topics list`")


ROLLOUT_PARTITIONS = 4

TOPICS = Catalog(
    tasks=Topic("forge.tasks", "group_id", ("Task",), ROLLOUT_PARTITIONS, FOREVER,
                ("rollout controller", "user"), ("processors", "scheduler"),
                doc="Task instances in submission order (seq)."),
    sessions=Topic("forge.sessions", "group_id", ("SessionStarted", "SessionFinished"), ROLLOUT_PARTITIONS, FOREVER,
                   ("ingress",), ("processors",), doc="One session = one rollout of one agent."),
    completions=Topic("forge.completions", "group_id", ("Completion",), ROLLOUT_PARTITIONS, FOREVER,
                      ("ingress",), ("processors",), doc="Exact token ids and logprobs of every completion."),
    tool_spans=Topic("forge.tool_spans", "group_id", ("ToolSpan",), ROLLOUT_PARTITIONS, FOREVER,
                     ("ingress", "agent"), ("processors",), doc="Tool calls with arguments, status and wall time."),
    rewards=Topic("forge.rewards", "group_id", ("Reward",), ROLLOUT_PARTITIONS, FOREVER,
                  ("grader", "processors"), ("processors", "analytics"), doc="Outcome, process and time rewards."),
    trajectories=Topic("forge.trajectories", "group_id", ("Trajectory",), ROLLOUT_PARTITIONS, 30 * DAY_MS,
                       ("processors",), ("analytics", "parquet sink"), doc="Assembled sessions with advantages."),
    samples=Topic("forge.samples", "group_id", ("TrainSample", "GroupSkipped"), ROLLOUT_PARTITIONS, 30 * DAY_MS,
                  ("processors",), ("scheduler", "trainer"),
                  doc="One packed prefix tree per group, or why the group has none (GroupSkipped)."),
    policy=Topic("forge.policy", "run", ("PolicyVersion",), 1, FOREVER,
                 ("trainer",), ("engines", "gateway"), doc="Published weights, in version order."),
    train_metrics=Topic("forge.train_metrics", "run", ("TrainStep",), 1, FOREVER,
                        ("trainer",), ("analytics", "scheduler"), doc="One record per optimizer step."),
    evals=Topic("forge.evals", "run", ("EvalResult",), 1, FOREVER,
                ("forge-stream eval",), ("analytics", "tensorboard sink"),
                doc="Held-out evaluations: mean outcome reward per domain and policy version."),
    dlq=Topic("forge.dlq", "group_id or source topic", ("DeadLetter",), 1, 30 * DAY_MS,
              ("any",), ("operators",), doc="Undecodable or invalid records with their original bytes."),
)
