"""Cluster administration: create the catalog's topics (idempotently), check and repair them, describe what is
there.

`check_topics` is what `up` and every service run at start: each catalog topic must exist with the catalog's
partition count and configs (a topic auto-created with one partition would split a group's events, and faust
refuses co-partitioned topics that differ) and with the deployment's replication (`forge_stream.topics.Replication`:
the replication factor, and `min.insync.replicas` among the configs; a topic kept by one broker loses what that
broker had when it dies). A mismatch is refused with the command that fixes it.
`describe` backs `forge-stream status`: broker reachability, topics with partitions and end offsets, and the
lag of every consumer group.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from confluent_kafka import Consumer, ConsumerGroupTopicPartitions, KafkaException, TopicPartition
from confluent_kafka.admin import (AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic,
                                  ResourceType)

from forge_stream.topics import EMBEDDED, TOPICS, Replication, Topic


QUIET = {"log_level": 0}  # librdkafka would print a line per reconnect attempt when the broker is down
PROBLEMS = ("missing", "partitions", "replication", "configs")


class TopicMismatch(RuntimeError):
    """The cluster's topics differ from the catalog; the message lists each difference and the fixing command."""


def admin_client(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap, **QUIET})


def topics_command(command: str, bootstrap: str, replication: Replication) -> str:
    """The `forge-stream topics COMMAND` line that works on this cluster with this replication."""
    flags = ("" if replication == EMBEDDED else
             f" --replication-factor {replication.factor} --min-insync-replicas {replication.min_insync}")
    return f"forge-stream topics {command} -b {bootstrap}{flags}"


def create_topics(bootstrap: str, topics: list[Topic] | None = None, timeout: float = 30.0,
                  replication: Replication = EMBEDDED) -> dict[str, str]:
    """Create every catalog topic that is missing, replicated as `replication`; returns {name: "created" |
    "exists"}. TopicMismatch when the cluster has fewer brokers than the replication factor."""
    admin = admin_client(bootstrap)
    topics = topics or TOPICS.all()
    metadata = admin.list_topics(timeout=timeout)
    wanted = [t for t in topics if t.name not in metadata.topics]
    result = {t.name: "exists" for t in topics if t.name in metadata.topics}
    if wanted and len(metadata.brokers) < replication.factor:
        raise TopicMismatch(
            f"the deployment's replication factor is {replication.factor}, but the Kafka cluster at {bootstrap} has "
            f"{len(metadata.brokers)} broker(s): start the missing brokers, or deploy with a replication factor of at "
            f"most {len(metadata.brokers)} (the topology's kafka.replication_factor)")
    if wanted:
        futures = admin.create_topics(
            [NewTopic(t.name, num_partitions=t.partitions, replication_factor=replication.factor,
                      config=t.config(replication)) for t in wanted],
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


@contextmanager
def scratch_topic(bootstrap: str, name: str, partitions: int, timeout: float = 30.0) -> Iterator[str]:
    """A topic outside the catalog for the duration of a block (a benchmark's), deleted after it; yields its name."""
    admin = admin_client(bootstrap)
    for future in admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=-1)],
                                      request_timeout=timeout).values():
        future.result()
    try:
        yield name
    finally:
        for future in admin.delete_topics([name], request_timeout=timeout).values():
            future.result()


def _factors(partitions: dict) -> str:
    """The replication factor of a topic's partitions as metadata shows them: "3", or "1 to 3" when they differ."""
    counts = sorted({len(p.replicas) for p in partitions.values()})
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"


def topic_problems(bootstrap: str, topics: list[Topic] | None = None, timeout: float = 30.0,
                   replication: Replication = EMBEDDED) -> dict[str, list[str]]:
    """What differs from the catalog and the deployment's replication, per topic: {"missing": [...],
    "partitions": [...], "replication": [...], "configs": [...]} (min.insync.replicas is among the configs)."""
    admin = admin_client(bootstrap)
    topics = topics or TOPICS.all()
    metadata = admin.list_topics(timeout=timeout)
    problems: dict[str, list[str]] = {kind: [] for kind in PROBLEMS}
    present = []
    for t in topics:
        meta = metadata.topics.get(t.name)
        if meta is None or meta.error is not None:
            problems["missing"].append(f"{t.name} does not exist")
            continue
        present.append(t)
        if len(meta.partitions) != t.partitions:
            problems["partitions"].append(f"{t.name} has {len(meta.partitions)} partition(s); the catalog says "
                                          f"{t.partitions}")
        factors = _factors(meta.partitions)
        if factors != str(replication.factor):
            problems["replication"].append(f"{t.name} has replication factor {factors}; the deployment says "
                                           f"{replication.factor}")
    if present:
        futures = admin.describe_configs([ConfigResource(ResourceType.TOPIC, t.name) for t in present],
                                         request_timeout=timeout)
        by_name = {t.name: t for t in present}
        for resource, future in futures.items():
            have = future.result()
            for key, want in by_name[resource.name].config(replication).items():
                value = have[key].value if key in have else None
                if value != want:
                    said = "the deployment says" if key == "min.insync.replicas" else "the catalog says"
                    problems["configs"].append(f"{resource.name} has {key}={value}; {said} {want}")
    return problems


def check_topics(bootstrap: str, topics: list[Topic] | None = None, timeout: float = 30.0,
                 replication: Replication = EMBEDDED) -> None:
    """Raise TopicMismatch, saying how to fix it, unless every catalog topic is as the catalog says and replicated
    as `replication` says."""
    problems = topic_problems(bootstrap, topics, timeout, replication)
    if not any(problems.values()):
        return
    lines = [f"the topics on Kafka at {bootstrap} differ from forge-stream's catalog (replication factor "
             f"{replication.factor}, min.insync.replicas {replication.min_insync}):"]
    lines += [f"  - {p}" for kind in PROBLEMS for p in problems[kind]]
    if problems["missing"]:
        lines.append(f"Create the missing topics: {topics_command('create', bootstrap, replication)}")
    if problems["configs"]:
        lines.append(f"Set the configs: {topics_command('repair', bootstrap, replication)}")
    if problems["partitions"]:
        lines.append("A topic's partition count cannot be lowered, and raising it moves keys to other partitions "
                     "(a group's events must share one). Delete and recreate those topics, losing their records "
                     f"(stop the services first): {topics_command('repair --recreate', bootstrap, replication)}")
    if problems["replication"]:
        recreate = topics_command("repair --recreate", bootstrap, replication)
        lines.append("A replication factor is not a topic config: raise it in place with a partition reassignment "
                     "(Kafka's kafka-reassign-partitions.sh), or delete and recreate those topics, losing their "
                     f"records (stop the services first): {recreate}")
    if problems["replication"] or any("min.insync.replicas" in p for p in problems["configs"]):
        lines.append("The deployment's replication is its topology's (kafka.replication_factor and "
                     "kafka.min_insync_replicas; `up` hands it to the services): a command run by hand takes it "
                     "from FORGE_REPLICATION_FACTOR and FORGE_MIN_INSYNC_REPLICAS (default 1 and 1).")
    raise TopicMismatch("\n".join(lines))


def repair_topics(bootstrap: str, recreate: bool = False, timeout: float = 60.0,
                  replication: Replication = EMBEDDED) -> dict[str, str]:
    """Create missing topics, set configs that differ, and (with `recreate`) delete and recreate the topics whose
    partition count or replication factor differs; returns {name: what was done}."""
    admin = admin_client(bootstrap)
    done: dict[str, str] = {}
    problems = topic_problems(bootstrap, timeout=timeout, replication=replication)
    wrong = sorted({p.split(" ", 1)[0] for p in problems["partitions"] + problems["replication"]})
    if wrong and recreate:
        for future in admin.delete_topics(wrong, operation_timeout=timeout).values():
            future.result()
        deadline = time.monotonic() + timeout
        while set(wrong) & set(admin.list_topics(timeout=timeout).topics) and time.monotonic() < deadline:
            time.sleep(0.5)
        done.update({name: "recreated" for name in wrong})
    for name, result in create_topics(bootstrap, timeout=timeout, replication=replication).items():
        if result == "created":
            done.setdefault(name, "created")
    configs = [p.split(" ", 1)[0] for p in topic_problems(bootstrap, timeout=timeout,
                                                          replication=replication)["configs"]]
    if configs:
        resources = [ConfigResource(ResourceType.TOPIC, t.name, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in t.config(replication).items()])
            for t in TOPICS.all() if t.name in configs]
        for resource, future in admin.incremental_alter_configs(resources, request_timeout=timeout).items():
            future.result()
            done[resource.name] = "configs set"
    return done


def wait_for_kafka(bootstrap: str, echo=print, timeout: float | None = None) -> None:
    """Block until the cluster answers (a service started while Kafka is away waits rather than exiting), or, with a
    `timeout`, raise TimeoutError once it has not answered for that long."""
    admin = admin_client(bootstrap)
    deadline = None if timeout is None else time.monotonic() + timeout
    told = False
    while True:
        left = 5.0 if deadline is None else min(5.0, max(0.5, deadline - time.monotonic()))
        try:
            if admin.list_topics(timeout=left).brokers:
                return
        except KafkaException:
            pass
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"Kafka at {bootstrap} did not answer within {timeout:.0f}s")
        if not told:
            echo(f"waiting for Kafka at {bootstrap}...")
            told = True
        time.sleep(1.0)


def ready_topics(bootstrap: str, echo=print, missing_wait_s: float = 60.0,
                 replication: Replication = EMBEDDED) -> None:
    """What a service does before it starts: wait for Kafka, give missing topics `missing_wait_s` to be created
    (`up` or a `topics create` job may be at it), then refuse to run on topics unlike the catalog or replicated
    otherwise than `replication` says."""
    wait_for_kafka(bootstrap, echo)
    deadline = time.monotonic() + missing_wait_s
    told = False
    while time.monotonic() < deadline:
        problems = topic_problems(bootstrap, replication=replication)
        if not problems["missing"] or any(problems[kind] for kind in PROBLEMS if kind != "missing"):
            break
        if not told:
            echo(f"waiting for the catalog's topics ({problems['missing'][0]}; `forge-stream topics create` "
                 "makes them)")
            told = True
        time.sleep(2.0)
    check_topics(bootstrap, replication=replication)


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    return {p: high for p, (_, high) in partition_offsets(bootstrap, topic, partitions).items()}


def partition_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, tuple[int, int]]:
    """Each partition's (start, end) offsets: the oldest record still kept and the next one to be written."""
    return watermarks(bootstrap, {topic: partitions})[topic]


def watermarks(bootstrap: str, topics: dict[str, int]) -> dict[str, dict[int, tuple[int, int]]]:
    """`partition_offsets` of several topics (name: partitions), with one client."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-stream-status",
                         "enable.auto.commit": False, **QUIET})
    try:
        return {topic: {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                        for p in range(partitions)} for topic, partitions in topics.items()}
    finally:
        consumer.close()


def describe(bootstrap: str, timeout: float = 5.0) -> dict:
    """A JSON-ready picture of the cluster: reachability, topics, end offsets, consumer-group lag.

    A group's lag counts, on each partition it committed on, the records after its commit; on a partition its
    members are assigned but never committed on, the whole partition (it starts from the earliest record); such
    partitions that hold records are listed under `uncommitted`. A stream processor's state topics (changelogs)
    are not its input and do not count. A group with no commits and no assignment has lag None
    (shown as "no commits"), never 0. `members` is how many consumers are in the group now (None when it could not
    be described): a group with none is idle, its lag a backlog that nothing reads (a one-shot export that finished,
    a service that is down).
    """
    admin = admin_client(bootstrap)
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        return {"bootstrap_servers": bootstrap, "reachable": False, "error": str(exc)}
    sizes = {name: len(meta.partitions) for name, meta in sorted(metadata.topics.items()) if not name.startswith("__")}
    # The groups' commits first, the end offsets after: a commit never passes the end offset of its moment, and end
    # offsets only grow, so no lag comes out negative while the groups keep committing (read the other way round,
    # a busy group's lag can).
    listed = admin.list_consumer_groups(request_timeout=timeout).result()
    names = sorted(g.group_id for g in listed.valid)
    described = admin.describe_consumer_groups(names, request_timeout=timeout) if names else {}
    commits = {}
    for group in names:
        result = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)])[group].result()
        commits[group] = {(tp.topic, tp.partition): tp.offset for tp in result.topic_partitions
                          if tp.offset >= 0 and tp.topic in sizes}
    topics = {}
    for name, offsets in watermarks(bootstrap, sizes).items():
        ends = {p: high for p, (_, high) in offsets.items()}
        topics[name] = {"partitions": sizes[name], "end_offsets": ends,
                        "start_offsets": {p: low for p, (low, _) in offsets.items()}, "messages": sum(ends.values())}
    groups = {}
    for group in names:
        members, assigned = _membership(described[group], topics)
        groups[group] = {**_lag(commits[group], assigned, topics), "members": members}
    return {"bootstrap_servers": bootstrap, "reachable": True, "brokers": len(metadata.brokers),
            "topics": topics, "consumer_groups": groups}


def _membership(future, topics: dict) -> tuple[int | None, set[tuple[str, int]]]:
    """How many members the group has now and the partitions they hold (None and none when it cannot be
    described)."""
    try:
        members = future.result().members
    except KafkaException:
        return None, set()
    return len(members), {(tp.topic, tp.partition) for m in members for tp in m.assignment.topic_partitions
                          if tp.topic in topics and not _state_topic(tp.topic)}


def _state_topic(name: str) -> bool:
    """A stream processor's own state (faust's and Kafka Streams' `*-changelog` tables, faust's assignor topic):
    its workers read it back on recovery and never commit on it, so its records are not a backlog."""
    return name.endswith("-changelog") or name.endswith("__assignor-__leader")


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
            if behind:
                uncommitted.append(f"{topic}[{p}]")
        per_topic[topic] = per_topic.get(topic, 0) + behind
    return {"lag": sum(per_topic.values()), "lag_by_topic": per_topic, "uncommitted": uncommitted}
