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
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-stream-status",
                         "enable.auto.commit": False, **QUIET})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def describe(bootstrap: str, timeout: float = 5.0) -> dict:
    """A JSON-ready picture of the cluster: reachability, topics, end offsets, consumer-group lag."""
    admin = admin_client(bootstrap)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        return {"bootstrap_servers": bootstrap, "reachable": False, "error": str(exc)}
    topics = {}
    for name, meta in sorted(metadata.topics.items()):
        if name.startswith("__"):
            continue
        offsets = end_offsets(bootstrap, name, len(meta.partitions))
        topics[name] = {"partitions": len(meta.partitions), "end_offsets": offsets,
                        "messages": sum(offsets.values())}
    groups = {}
    listed = admin.list_consumer_groups(request_timeout=timeout).result()
    for group in sorted(g.group_id for g in listed.valid):
        committed = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result()
        lag = 0
        per_topic: dict[str, int] = {}
        for tp in committed.topic_partitions:
            if tp.offset < 0 or tp.topic not in topics:
                continue
            behind = topics[tp.topic]["end_offsets"].get(tp.partition, 0) - tp.offset
            per_topic[tp.topic] = per_topic.get(tp.topic, 0) + behind
            lag += behind
        groups[group] = {"lag": lag, "lag_by_topic": per_topic}
    return {"bootstrap_servers": bootstrap, "reachable": True, "brokers": len(metadata.brokers),
            "topics": topics, "consumer_groups": groups}
