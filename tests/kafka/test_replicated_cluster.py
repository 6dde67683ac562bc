"""A three-broker KRaft cluster (replication factor 3, min.insync.replicas 2): rollouts through the gateway and
training through the windowed consumer go on while one broker is SIGKILLed and restarted; nothing acknowledged is
lost and nothing is trained twice."""

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from forge_stream.gateway.app import create_app
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.admin import TopicMismatch, check_topics, create_topics
from forge_stream.kafka.broker import LocalCluster
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.scheduler.consumer import SchedulerSettings, WindowedConsumer, start_at_end
from forge_stream.settings import ForgeSettings
from forge_stream.topics import EMBEDDED, TOPICS, Replication

sys.path.insert(0, str(Path(__file__).parents[1] / "scheduler"))
from helpers import serving, until  # noqa: E402
from scheduler_records import group_id, sample, task  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), ForgeSettings().cache_dir, nodes=3)
    try:
        cluster.start()
        create_topics(cluster.bootstrap, replication=Replication(3, 2))  # cluster.yaml's
        yield cluster
    finally:
        cluster.stop()


def test_the_catalog_is_replicated_three_ways_with_two_in_sync(cluster):
    admin = AdminClient({"bootstrap.servers": cluster.bootstrap})

    def every_topic_known():  # the broker that answers may learn of just-created topics a moment after the controller
        metadata = admin.list_topics(timeout=10)
        return metadata if all(t.name in metadata.topics for t in TOPICS.all()) else None

    metadata = until(every_topic_known, 30, lambda: f"topics known: {sorted(admin.list_topics(timeout=10).topics)}")
    assert len(metadata.brokers) == 3
    for topic in TOPICS.all():
        partitions = metadata.topics[topic.name].partitions
        assert len(partitions) == topic.partitions
        assert all(len(p.replicas) == 3 for p in partitions.values()), topic.name
    resource = ConfigResource(ConfigResource.Type.TOPIC, TOPICS.completions.name)
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    assert configs["min.insync.replicas"].value == "2"
    check_topics(cluster.bootstrap, replication=Replication(3, 2))  # what `up cluster` and its services check
    with pytest.raises(TopicMismatch, match="forge.completions has replication factor 3; the deployment says 1"):
        check_topics(cluster.bootstrap, replication=EMBEDDED)


class Agents(threading.Thread):
    """Scripted agents: sessions of two chat turns each, counting the turns the gateway acknowledged (200)."""

    def __init__(self, gateway: str, run: str, sessions: int):
        super().__init__(daemon=True)
        self.gateway, self.run_id, self.sessions = gateway, run, sessions
        self.acked: dict[str, int] = {}
        self.refused = 0

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            for i in range(self.sessions):
                opened = client.post(f"{self.gateway}/v1/sessions", json={"group_id": f"{self.run_id}-s{i}",
                                                                          "task_id": "t"})
                if opened.status_code != 201:
                    self.refused += 1
                    continue
                session = opened.json()
                self.acked[session["session_id"]] = 0
                for turn in range(2):
                    answer = client.post(f"{session['base_url']}/chat/completions", json={
                        "model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}]})
                    if answer.status_code == 200:
                        self.acked[session["session_id"]] += 1
                    else:  # 503: Kafka did not acknowledge in time; nothing is claimed
                        self.refused += 1
                client.post(f"{self.gateway}/v1/sessions/{session['session_id']}/finish", json={})
                time.sleep(0.05)


class Training(threading.Thread):
    """The windowed consumer training every group of the run (a counting trainer), steps until all are trained."""

    def __init__(self, settings: SchedulerSettings, groups: int):
        super().__init__(daemon=True)
        self.settings, self.groups = settings, groups
        self.trained: list[str] = []
        self.policy_version = 0

    def train(self, batch):
        self.policy_version += 1
        return {"loss": 1.0}

    def run(self) -> None:
        consumer = WindowedConsumer(self.settings)
        deadline = time.monotonic() + 240
        while len(self.trained) < self.groups and time.monotonic() < deadline:
            for step in consumer.run(self, steps=1, wait_s=2):
                self.trained += step["group_ids"]
        consumer.close()


def _coordinator(bootstrap: str, group: str) -> int:
    """The node id of the broker coordinating consumer group `group` (1 when it is not known yet)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        [future] = admin.describe_consumer_groups([group]).values()
        return future.result(timeout=10).coordinator.id
    except Exception:  # the group has not joined yet
        return 1


def test_rollouts_and_training_survive_a_broker_sigkill(cluster, run_id):
    groups = 24
    settings = SchedulerSettings(bootstrap=cluster.bootstrap, run=run_id, batch_size=4)
    start_at_end(settings)
    training = Training(settings, groups)
    training.start()
    with serving(ScriptedEngine(("The answer is 42.",))) as engine, \
            serving(create_app(GatewaySettings(engines=(engine,), bootstrap=cluster.bootstrap))) as gateway:
        agents = Agents(gateway, run_id, sessions=30)
        agents.start()
        producer = EventProducer(cluster.bootstrap)
        for seq in range(groups):  # the groups' Tasks and samples arrive over the kill and the restart
            producer.produce(TOPICS.tasks, group_id(run_id, seq), task(run_id, seq))
            producer.produce(TOPICS.samples, group_id(run_id, seq), sample(run_id, seq))
            if seq == 6:  # the training consumer group's coordinator: its members must rejoin elsewhere
                victim = cluster.nodes[_coordinator(cluster.bootstrap, settings.name) - 1]
                victim.kill()
                assert victim.pid() is None
            if seq == 14:
                victim.start(wait=False)
            time.sleep(0.3)
        producer.close()  # every Task and sample acknowledged (acks=all, idempotent)
        agents.join(240)
        cluster.wait_brokers(3)
    training.join(300)

    sessions = set(agents.acked)
    completions = [e.record for e in read_slice(cluster.bootstrap, TOPICS.completions, Slice())
                   if e.record["session_id"] in sessions]
    ids = [c["event_id"] for c in completions]
    print(f"\n{len(sessions)} sessions, {sum(agents.acked.values())} completions acknowledged, {agents.refused} "
          f"refused, {len(completions)} recorded; {len(training.trained)} of {groups} groups trained")
    assert len(ids) == len(set(ids)), "a completion was recorded twice"
    for session, acked in agents.acked.items():
        recorded = sorted(c["turn"] for c in completions if c["session_id"] == session)
        assert len(recorded) >= acked, f"session {session}: {acked} acknowledged, {len(recorded)} recorded"
        assert len(recorded) == len(set(recorded))
    assert sum(agents.acked.values()) >= 30, "the gateway kept serving through the kill"
    assert len(training.trained) == len(set(training.trained)), "a group was trained twice"
    assert set(training.trained) == {group_id(run_id, s) for s in range(groups)}, "a group was lost"
