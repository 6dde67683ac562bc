"""Cluster administration: create the catalog's topics (idempotently) and describe what is there.

`describe` backs `forge-stream status`: broker reachability, topics with partitions and end offsets, and the
lag of every consumer group.
"""

from __future__ import annotations

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from forge_stream.topics import TOPICS, Topic


QUIET = {"log_level": 0}  # librdkafka would print a line per reconnect attempt when the broker is down


def admin_client(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, **QUIET})


def create_topics(bootstrap: str, topics: list[Topic] | None = None, timeout: float = 30.0) -> dict[str, str]:
    """Create every catalog topic that is missing; returns {name: "created" | "exists"}."""
    admin = admin_client(bootstrap)
    topics = topics or TOPICS.all()
    existing = set(admin.list_topics(timeout=timeout).topics)
    wanted = [t for t in topics if t.name not in existing]
    result = {t.name: "exists" for t in topics if t.name in existing}
    if wanted:
        futures = admin.create_topics(
            [NewTopic(t.name, num_partitions=t.partitions, replication_factor=-1, config=t.config()) for t in wanted],
            request_timeout=timeout,
        )
        for name, future in futures.items():
            try:
                future.result()
                result[name] = "created"
            except KafkaException as exc:
                if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                    raise
                result[name] = "exists"
    return result


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    return {p: high for p, (_, high) in partition_offsets(bootstrap, topic, partitions).items()}


def partition_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, tuple[int, int]]:
    """Each partition's (start, end) offsets: the oldest record still kept and the next one to be written."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-stream-status",
                         "enable.auto.commit": False, **QUIET})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in range(partitions)}
    finally:
        consumer.close()


def describe(bootstrap: str, timeout: float = 5.0) -> dict:
    """A JSON-ready picture of the cluster: reachability, topics, end offsets, consumer-group lag.

    A group's lag counts, on each partition it committed on, the records after its commit; on a partition its
    members are assigned but never committed on, the whole partition (it starts from the earliest record).
    Those partitions are listed under `uncommitted`. A group with no commits and no assignment has lag None
    (shown as "no commits"), never 0.
    """
    admin = admin_client(bootstrap)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        return {"bootstrap_servers": bootstrap, "reachable": False, "error": str(exc)}
    topics = {}
    for name, meta in sorted(metadata.topics.items()):
        if name.startswith("__"):
            continue
        offsets = partition_offsets(bootstrap, name, len(meta.partitions))
        ends = {p: high for p, (_, high) in offsets.items()}
        topics[name] = {"partitions": len(meta.partitions), "end_offsets": ends,
                        "start_offsets": {p: low for p, (low, _) in offsets.items()}, "messages": sum(ends.values())}
    groups = {}
    listed = admin.list_consumer_groups(request_timeout=timeout).result()
    names = sorted(g.group_id for g in listed.valid)
    described = admin.describe_consumer_groups(names, request_timeout=timeout) if names else {}
    for group in names:
        result = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result()
        committed = {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions
                     if tp.offset >= 0 and tp.topic in topics}
        groups[group] = _lag(committed, _assigned(described[group], topics), topics)
    return {"bootstrap_servers": bootstrap, "reachable": True, "brokers": len(metadata.brokers),
            "topics": topics, "consumer_groups": groups}


def _assigned(future, topics: dict) -> set[tuple[str, int]]:
    """The partitions the group's members hold now (none when it has no members or cannot be described)."""
    try:
        members = future.result().members
    except KafkaException:
        return set()
    return {(tp.topic, tp.partition) for m in members for tp in m.assignment.topic_partitions if tp.topic in topics}


def _lag(committed: dict[tuple[str, int], int], assigned: set[tuple[str, int]], topics: dict) -> dict:
    if not committed and not assigned:
        return {"lag": None, "lag_by_topic": {}, "uncommitted": []}
    per_topic: dict[str, int] = {}
    uncommitted = []
    for topic, p in sorted(committed.keys() | assigned):
        end = topics[topic]["end_offsets"].get(p, 0)
        if (topic, p) in committed:
            behind = end - committed[(topic, p)]
        else:
            behind = end - topics[topic]["start_offsets"].get(p, 0)
            uncommitted.append(f"{topic}[{p}]")
        per_topic[topic] = per_topic.get(topic, 0) + behind
    return {"lag": sum(per_topic.values()), "lag_by_topic": per_topic, "uncommitted": uncommitted}
