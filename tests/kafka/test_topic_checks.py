"""Topics come from the catalog only: the embedded broker creates none on its own, start-up refuses topics unlike
the catalog or replicated otherwise than the deployment says (saying how to fix them, and the fix works), and a
Kafka outage is waited out, not fatal."""

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource, NewTopic, ResourceType

from forge_stream.kafka.admin import TopicMismatch, admin_client, check_topics, create_topics, repair_topics
from forge_stream.kafka.broker import BrokerConfig, LocalBroker, free_port
from forge_stream.kafka.consumer import dead_letter
from forge_stream.kafka.producer import EventProducer
from forge_stream.settings import ForgeSettings
from forge_stream.topics import TOPICS, Replication, Topic


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory):
    """A broker of this module's own: its topics are broken on purpose, and it is stopped and started again."""
    broker = LocalBroker(BrokerConfig(tmp_path_factory.mktemp("kafka-own"), ForgeSettings().cache_dir,
                                      port=free_port(), controller_port=free_port()))
    yield broker, broker.start()
    broker.stop()


def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_REGISTRY_PORT=str(free_port()))
    return env


def test_producing_to_an_unknown_topic_fails_instead_of_creating_it(kafka_bootstrap, run_id):
    topic = f"forge.not-in-the-catalog-{run_id}"
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.timeout.ms": 5000})
    errors = []
    producer.produce(topic, b"value", on_delivery=lambda err, msg: errors.append(err))
    producer.flush(20)
    assert len(errors) == 1 and errors[0] is not None, errors
    assert topic not in admin_client(kafka_bootstrap).list_topics(timeout=10).topics


def test_wrong_topics_make_start_up_refuse_with_the_fix(own_broker, tmp_path):
    _, bootstrap = own_broker
    admin = admin_client(bootstrap)
    # what a producer's auto-creation leaves on a broker that allows it: forge.tool_spans with 1 partition
    admin.create_topics([NewTopic(TOPICS.tool_spans.name, num_partitions=1, replication_factor=1)])[
        TOPICS.tool_spans.name].result()
    create_topics(bootstrap)
    admin.incremental_alter_configs([ConfigResource(ResourceType.TOPIC, TOPICS.dlq.name, incremental_configs=[
        ConfigEntry("retention.ms", "1000", incremental_operation=AlterConfigOpType.SET)])])
    env = _env(tmp_path)
    topology = tmp_path / "registry-only.yaml"
    topology.write_text("name: registry-only\nservices:\n  - registry\n")

    up = subprocess.run([sys.executable, "-m", "forge_stream", "up", str(topology), "-b", bootstrap], env=env,
                        capture_output=True, text=True, timeout=180)
    assert up.returncode == 1
    assert "forge.tool_spans has 1 partition(s); the catalog says 4" in up.stderr
    assert f"forge.dlq has retention.ms=1000; the catalog says {TOPICS.dlq.retention_ms}" in up.stderr
    fix = f"forge-stream topics repair --recreate -b {bootstrap}"
    assert fix in up.stderr
    assert not (tmp_path / "home" / "run" / "services.json").exists()  # nothing was started

    worker = subprocess.run([sys.executable, "-m", "forge_stream", "processors", "run", "-b", bootstrap,
                             "--data-dir", str(tmp_path / "processors")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert worker.returncode == 3 and "refusing to start" in worker.stderr and fix in worker.stderr

    repaired = subprocess.run([sys.executable, "-m", "forge_stream", *fix.split()[1:], "--json"], env=env,
                              capture_output=True, text=True, timeout=180)
    assert repaired.returncode == 0, repaired.stderr
    assert json.loads(repaired.stdout) == {TOPICS.tool_spans.name: "recreated", TOPICS.dlq.name: "configs set"}
    check_topics(bootstrap)
    assert len(admin.list_topics(timeout=10).topics[TOPICS.tool_spans.name].partitions) == TOPICS.tool_spans.partitions


def test_topics_replicated_otherwise_than_the_deployment_says_are_refused(kafka_bootstrap, tmp_path):
    """A deployment stated at replication factor 3 / min.insync.replicas 2 (cluster.yaml's) on topics kept by one
    broker: `up` refuses, and so does a service told that replication (as `up` tells it), each naming the topic,
    what it has, what it needs and the fix; `topics create` refuses a factor the cluster has too few brokers for."""
    env = {**_env(tmp_path), "FORGE_REPLICATION_FACTOR": "3", "FORGE_MIN_INSYNC_REPLICAS": "2"}
    topology = tmp_path / "replicated.yaml"
    topology.write_text("name: replicated\nkafka:\n  replication_factor: 3\n  min_insync_replicas: 2\n"
                        "services:\n  - registry\n")
    fix = f"forge-stream topics repair --recreate -b {kafka_bootstrap} --replication-factor 3 --min-insync-replicas 2"
    up = subprocess.run([sys.executable, "-m", "forge_stream", "up", str(topology), "-b", kafka_bootstrap],
                        env=_env(tmp_path), capture_output=True, text=True, timeout=180)
    worker = subprocess.run([sys.executable, "-m", "forge_stream", "processors", "run", "-b", kafka_bootstrap,
                             "--data-dir", str(tmp_path / "processors")], env=env, capture_output=True, text=True,
                            timeout=120)
    assert up.returncode == 1 and worker.returncode == 3, (up.stderr, worker.stderr)
    assert "refusing to start" in worker.stderr
    for refused in (up.stderr, worker.stderr):
        for topic in TOPICS.all():
            assert f"{topic.name} has replication factor 1; the deployment says 3" in refused
            assert f"{topic.name} has min.insync.replicas=1; the deployment says 2" in refused
        assert fix in refused and "kafka-reassign-partitions" in refused
    assert not (tmp_path / "home" / "run" / "services.json").exists()  # nothing was started

    created = subprocess.run([sys.executable, "-m", "forge_stream", "topics", "create", "-b", kafka_bootstrap,
                              "--replication-factor", "3"], env=_env(tmp_path), capture_output=True, text=True,
                             timeout=120)
    assert created.returncode == 0, created.stderr  # every topic exists: nothing to create
    check_topics(kafka_bootstrap)  # the shared broker's topics are as the embedded default says (1/1)
    with pytest.raises(TopicMismatch, match="replication factor is 3, but the Kafka cluster at .* has 1 broker"):
        create_topics(kafka_bootstrap, [Topic(f"forge.test-rf3-{os.getpid()}", "k", ("Task",), 1, 1000, (), ())],
                      replication=Replication(3, 2))


@pytest.mark.slow
def test_a_kafka_outage_is_waited_out(own_broker, tmp_path):
    broker, bootstrap = own_broker
    repair_topics(bootstrap, recreate=True)
    producer = EventProducer(bootstrap, patient=True)
    broker.stop()
    sent: dict = {}
    record = dead_letter("forge.test", 0, 0, None, b"x", "outage test", "test_topic_checks")
    sender = threading.Thread(target=lambda: sent.update(offset=producer.send_sync(TOPICS.dlq, "k", record)))
    sender.start()
    port = free_port()
    log = open(tmp_path / "gateway.log", "wb")
    gateway = subprocess.Popen([sys.executable, "-m", "forge_stream", "gateway", "serve", "--engine",
                                f"http://127.0.0.1:{free_port()}", "--port", str(port), "-b", bootstrap,
                                "--wait-for-kafka"],  # as `up` starts it
                               env=_env(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(20)  # longer than the default producer's 15 s message timeout
        assert sender.is_alive() and "offset" not in sent
        assert gateway.poll() is None, (tmp_path / "gateway.log").read_text()
        assert "waiting for Kafka" in (tmp_path / "gateway.log").read_text()
        broker.start()
        sender.join(60)
        assert sent["offset"] >= 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise AssertionError("the gateway did not come up once Kafka was back")
    finally:
        gateway.terminate()
        gateway.wait(30)
        producer.close()
