"""Losing one broker of three loses nothing acknowledged: a three-broker KRaft cluster with the catalog's topics at
cluster.yaml's replication (factor 3, min.insync.replicas 2), both kinds of producer of forge-stream writing keyed
records with acks=all (the package's librdkafka EventProducer, and the aiokafka producer the processors' faust app
makes), and the broker leading one partition SIGKILLed mid-run. Then, read back from the two brokers left: every
acknowledged record is where its acknowledgement said, none is written twice (idempotence through the retries of
the failover), each key's records are in the order they were sent, on the partition Java's client would pick; and
every partition took acknowledged writes after the kill (two replicas in sync are enough)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import defaultdict

import pytest
from confluent_kafka import Consumer, TopicPartition

from forge_stream.kafka.admin import TopicMismatch, admin_client, check_topics, create_topics, topic_problems
from forge_stream.kafka.broker import LocalCluster
from forge_stream.kafka.partitioner import partition_for
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.reader import records_between
from forge_stream.settings import ForgeSettings
from forge_stream.topics import EMBEDDED, TOPICS, Replication
from topologies.processors import TopologyConfig, build_app

from helpers import until

pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(300)]  # about a minute on 2 idle cores

CLUSTER = Replication(3, 2)  # topologies/cluster.yaml's
TOPIC = TOPICS.rewards
KEYS = [f"group-{i}".encode() for i in range(16)]
BEFORE_S, AFTER_S = 4.0, 15.0  # writing before the kill, and after it (failover included)


class Writer(threading.Thread):
    """Writes keyed records (value "NAME:SEQ", key KEYS[seq % 16]) every few milliseconds until stopped, then waits
    for every acknowledgement; records (seq, partition, offset) of the acknowledged ones and counts the refused."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.acked: list[tuple[int, int, int]] = []
        self.refused = 0
        self.sent = 0
        self.first_after_kill: int | None = None  # the first seq sent after the kill
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def record(self, seq: int, err, partition: int, offset: int) -> None:
        if err is None:
            self.acked.append((seq, partition, offset))
        else:
            self.refused += 1

    def killed(self) -> None:
        self.first_after_kill = self.sent

    def run(self) -> None:
        try:
            self.write()
        except BaseException as exc:  # reported by the test
            self.error = exc


class RdkafkaWriter(Writer):
    def __init__(self, bootstrap: str):
        super().__init__("rdkafka")
        self.producer = EventProducer(bootstrap)

    def write(self) -> None:
        while not self.stop.is_set():
            seq = self.sent
            self.producer.produce_raw(TOPIC.name, KEYS[seq % len(KEYS)], f"{self.name}:{seq}".encode(),
                                      lambda err, msg, seq=seq: self.record(seq, err, msg.partition(), msg.offset()))
            self.sent += 1
            time.sleep(0.005)
        self.producer.close(60)


class FaustWriter(Writer):
    def __init__(self, bootstrap: str, data_dir):
        super().__init__("faust")
        self.app = build_app(TopologyConfig(bootstrap, data_dir, replication=CLUSTER))

    def write(self) -> None:
        asyncio.run(self._write())

    async def _write(self) -> None:
        producer = self.app.producer._new_producer()  # the aiokafka producer faust's app starts (idempotent)
        await producer.start()
        pending = []
        try:
            while not self.stop.is_set():
                seq = self.sent
                future = await producer.send(TOPIC.name, f"{self.name}:{seq}".encode(), key=KEYS[seq % len(KEYS)])
                pending.append((seq, future))
                self.sent += 1
                await asyncio.sleep(0.005)
            for seq, future in pending:
                try:
                    meta = await asyncio.wait_for(future, 60)
                    self.record(seq, None, meta.partition, meta.offset)
                except Exception as exc:  # not acknowledged: allowed, and counted
                    self.record(seq, exc, -1, -1)
        finally:
            await producer.stop()


@pytest.fixture
def cluster(tmp_path):
    cluster = LocalCluster(tmp_path / "cluster", ForgeSettings().cache_dir, nodes=3)
    try:
        cluster.start(echo=lambda *_: None)
        yield cluster
    finally:
        cluster.stop()


def read_back(bootstrap: str) -> dict[tuple[int, int], bytes]:
    """Every record of TOPIC by (partition, offset), up to each partition's high watermark."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "broker-loss-read", "enable.auto.commit": False,
                         "log_level": 0})
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(TOPIC.name, p), timeout=30)
                for p in range(TOPIC.partitions)}
        return {(msg.partition(), msg.offset()): msg.value() for p, (low, high) in ends.items()
                for msg in records_between(consumer, TOPIC.name, p, low, high, 30)}
    finally:
        consumer.close()


def test_a_broker_sigkilled_mid_run_loses_nothing_acknowledged(cluster, tmp_path):
    bootstrap = cluster.bootstrap
    create_topics(bootstrap, replication=CLUSTER)
    until(lambda: not any(topic_problems(bootstrap, replication=CLUSTER).values()), 60,
          lambda: f"topics not as cluster.yaml says: {topic_problems(bootstrap, replication=CLUSTER)}")
    check_topics(bootstrap, replication=CLUSTER)  # what `up cluster` and each of its services check
    with pytest.raises(TopicMismatch, match=f"{TOPIC.name} has replication factor 3; the deployment says 1"):
        check_topics(bootstrap, replication=EMBEDDED)

    writers = [RdkafkaWriter(bootstrap), FaustWriter(bootstrap, tmp_path / "faust")]
    for writer in writers:
        writer.start()
    time.sleep(BEFORE_S)
    admin = admin_client(bootstrap)
    leader = admin.list_topics(TOPIC.name, timeout=10).topics[TOPIC.name].partitions[0].leader
    victim = cluster.nodes[leader - 1]
    victim.kill()
    for writer in writers:
        writer.killed()
    assert victim.pid() is None

    def failed_over():  # the victim leads nothing and is out of every in-sync set; two replicas are still in sync
        partitions = admin.list_topics(TOPIC.name, timeout=10).topics[TOPIC.name].partitions.values()
        return all(p.leader not in (leader, -1) and leader not in p.isrs and len(p.isrs) == 2 for p in partitions)

    time.sleep(AFTER_S)
    for writer in writers:
        writer.stop.set()
    for writer in writers:
        writer.join(120)
        assert not writer.is_alive() and writer.error is None, (writer.name, writer.error)
    until(failed_over, 60, lambda: f"partitions: {admin.list_topics(TOPIC.name).topics[TOPIC.name].partitions}")

    log = read_back(bootstrap)
    where: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for place, value in log.items():
        where[value].append(place)
    for writer in writers:
        after = [a for a in writer.acked if a[0] >= writer.first_after_kill]
        print(f"\n{writer.name}: {writer.sent} sent, {len(writer.acked)} acknowledged ({len(after)} sent after the "
              f"kill of broker {leader}), {writer.refused} refused")
        assert len(writer.acked) > 100 and writer.first_after_kill > 0
        for seq, partition, offset in writer.acked:
            value = f"{writer.name}:{seq}".encode()
            assert log.get((partition, offset)) == value, f"{value!r}, acknowledged at {partition}/{offset}, is lost"
            assert partition == partition_for(KEYS[seq % len(KEYS)], TOPIC.partitions)
        duplicates = [v for v, places in where.items() if v.startswith(writer.name.encode()) and len(places) > 1]
        assert not duplicates, f"written twice: {duplicates[:5]}"
        for key_index in range(len(KEYS)):  # each key's records in the order they were sent
            offsets = [offset for seq, _, offset in sorted(writer.acked) if seq % len(KEYS) == key_index]
            assert offsets == sorted(offsets), f"{writer.name}: key {KEYS[key_index]!r} out of order"
        assert {partition for _, partition, _ in after} == set(range(TOPIC.partitions)), \
            f"{writer.name}: partitions that took no acknowledged write after the kill"
