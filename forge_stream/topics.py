"""The topic catalog: every Kafka topic forge-stream uses, with its key, value schemas, layout and owners.

Nobody spells a topic name elsewhere: code says `TOPICS.completions.name`. `forge-stream topics create` makes
them all (idempotently) with these settings.

Size limits live here too: each topic's `max_message_bytes` (its `max.message.bytes`, checked by EventProducer
before sending, so an event too large fails at once and by name instead of being refused by the broker), and
`TOPICS.largest_message_bytes()` sizes the producers' `message.max.bytes`, the local broker's `message.max.bytes`
and the processors' faust producer.

Replication is the topology's (`Replication`: every catalog topic of a deployment gets the same): how many brokers
keep each partition and how many of them must hold a record before an `acks=all` producer is told it is written.
The embedded default runs one broker (`EMBEDDED`, 1/1); `topologies/cluster.yaml` states 3/2 under `kafka:`, so one
broker of three can be lost without losing or refusing an acknowledged record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FOREVER = -1
DAY_MS = 24 * 3600 * 1000
MiB = 1024 * 1024


@dataclass(frozen=True)
class Replication:
    """A deployment's replication of the catalog's topics: `factor` brokers keep each partition (the replication
    factor), and a write is acknowledged once `min_insync` of them have it (the topic's `min.insync.replicas`; the
    producers send with acks=all). With factor F and min_insync M, F - M brokers can be lost with every partition
    still taking writes, and F - 1 without losing an acknowledged record."""

    factor: int = 1
    min_insync: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_insync <= self.factor:
            raise ValueError(f"min.insync.replicas {self.min_insync} must be between 1 and the replication factor "
                             f"{self.factor}")


EMBEDDED = Replication(1, 1)  # the embedded default's single broker


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
    max_message_bytes: int = MiB  # the largest record (value, key and batch framing) the topic takes

    def config(self, replication: Replication = EMBEDDED) -> dict[str, str]:
        """The topic configs it is created with and checked against, on a deployment replicated as `replication`."""
        return {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            "message.timestamp.type": "CreateTime",
            "max.message.bytes": str(self.max_message_bytes),
            "min.insync.replicas": str(replication.min_insync),
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

    def largest_message_bytes(self) -> int:
        return max(topic.max_message_bytes for topic in self.all())

    def by_name(self, name: str) -> Topic:
        for topic in self.all():
            if topic.name == name:
                return topic
        raise KeyError(f"{name!r} is not a forge-stream topic; see `forge-stream topics list`")


ROLLOUT_PARTITIONS = 4

TOPICS = Catalog(
    tasks=Topic("forge.tasks", "group_id", ("Task",), ROLLOUT_PARTITIONS, FOREVER,
                ("rollout controller", "user"), ("processors", "scheduler"),
                doc="Task instances in submission order (seq).", max_message_bytes=4 * MiB),
    sessions=Topic("forge.sessions", "group_id", ("SessionStarted", "SessionFinished"), ROLLOUT_PARTITIONS, FOREVER,
                   ("ingress",), ("processors",), doc="One session = one rollout of one agent."),
    completions=Topic("forge.completions", "group_id", ("Completion",), ROLLOUT_PARTITIONS, FOREVER,
                      ("ingress",), ("processors",), doc="Exact token ids and logprobs of every completion.",
                      max_message_bytes=8 * MiB),  # a 200K-token prompt recorded whole, with its messages
    tool_spans=Topic("forge.tool_spans", "group_id", ("ToolSpan",), ROLLOUT_PARTITIONS, FOREVER,
                     ("ingress", "agent"), ("processors",), doc="Tool calls with arguments, status and wall time.",
                     max_message_bytes=4 * MiB),
    rewards=Topic("forge.rewards", "group_id", ("Reward",), ROLLOUT_PARTITIONS, FOREVER,
                  ("grader", "processors"), ("processors", "analytics"), doc="Outcome, process and time rewards."),
    trajectories=Topic("forge.trajectories", "group_id", ("Trajectory",), ROLLOUT_PARTITIONS, 30 * DAY_MS,
                       ("processors",), ("analytics", "parquet sink"), doc="Assembled sessions with advantages.",
                       max_message_bytes=4 * MiB),
    samples=Topic("forge.samples", "group_id", ("TrainSample", "GroupSkipped", "SampleClaim"), ROLLOUT_PARTITIONS, 30 * DAY_MS,
                  ("processors", "rollout controller"), ("scheduler", "trainer"),
                  doc="One packed prefix tree per group, or why the group has none (GroupSkipped).",
                  max_message_bytes=64 * MiB),  # a group of long sessions: millions of tree rows
    policy=Topic("forge.policy", "run", ("PolicyVersion",), 1, FOREVER,
                 ("trainer",), ("engines", "gateway"), doc="Published weights, in version order."),
    train_metrics=Topic("forge.train_metrics", "run", ("TrainStep",), 1, FOREVER,
                        ("trainer",), ("analytics", "scheduler"), doc="One record per optimizer step."),
    evals=Topic("forge.evals", "run", ("EvalResult",), 1, FOREVER,
                ("forge-stream eval",), ("analytics", "tensorboard sink"),
                doc="Held-out evaluations: mean outcome reward per domain and policy version."),
    dlq=Topic("forge.dlq", "group_id or source topic", ("DeadLetter",), 1, 30 * DAY_MS,
              ("any",), ("operators",), doc="Undecodable or invalid records with their original bytes.",
              max_message_bytes=65 * MiB),  # any other topic's largest record, wrapped
)
