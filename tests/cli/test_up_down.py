"""`forge-stream up`, `status` and `down` on a fresh home: the broker starts, data survives a restart."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from confluent_kafka import Consumer, KafkaException, TopicPartition

from forge_stream.events import decode, encode
from forge_stream.kafka.admin import describe
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.producer import EventProducer
from forge_stream.processors.synthetic import group_events
from forge_stream.proc import alive as _alive
from forge_stream.services import Supervisor
from forge_stream.topics import TOPICS

from helpers import cli, read_events, until

pytestmark = pytest.mark.slow



def test_up_status_down_up_keeps_data(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    kafka, registry = free_port(), free_port()
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_KAFKA_PORT=str(kafka),
               FORGE_KAFKA_CONTROLLER_PORT=str(free_port()), FORGE_REGISTRY_PORT=str(registry),
               FORGE_ENGINE_PORT=str(free_port()))
    try:
        up = json.loads(cli(env, "up", "--json"))
        bootstrap = up["bootstrap_servers"]
        assert bootstrap == f"127.0.0.1:{kafka}" and up["embedded_broker"]
        assert set(up["topics"]) == {t.name for t in TOPICS.all()}
        assert httpx.get(f"http://127.0.0.1:{registry}/subjects").status_code == 200

        producer = EventProducer(bootstrap)
        sent = []
        for i in range(20):
            record = {"event_id": f"e{i}", "event_time": 1_764_000_000_000 + i, "task_id": f"t{i}",
                      "group_id": f"g{i}", "seq": i, "domain": "qa", "grader": "exact", "group_size": 4,
                      "prompt_json": "{}", "reference_json": "{}", "metadata": {}}
            producer.send_sync(TOPICS.tasks, record["group_id"], record)
            sent.append(record)
        producer.close()

        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "half-reader",
                             "auto.offset.reset": "earliest", "enable.auto.commit": False})
        consumer.assign([TopicPartition(TOPICS.tasks.name, 0, 0)])
        msg = consumer.poll(15)
        consumer.commit(message=msg, asynchronous=False)
        consumer.close()

        status = json.loads(cli(env, "status", "--json"))
        assert status["reachable"] and status["topics"][TOPICS.tasks.name]["messages"] == 20
        assert status["topics"][TOPICS.tasks.name]["partitions"] == TOPICS.tasks.partitions
        lag = status["consumer_groups"]["half-reader"]["lag"]
        assert lag == status["topics"][TOPICS.tasks.name]["end_offsets"]["0"] - 1
        assert status["consumer_groups"]["half-reader"]["members"] == 0  # it committed and left
        row = next(line for line in cli(env, "status").splitlines() if "half-reader" in line)
        assert "0 (idle)" in row and f"{lag} (nothing reads it now)" in row, row
        assert status["services"]["registry"]["healthy"]
        # from a shell that only knows the home (no FORGE_KAFKA_PORT): the deployment's Kafka, not the default
        home_only = {k: v for k, v in env.items() if k not in ("FORGE_KAFKA_PORT", "FORGE_KAFKA_CONTROLLER_PORT")}
        status = json.loads(cli(home_only, "status", "--json"))
        assert status["bootstrap_servers"] == bootstrap and status["reachable"]
        assert status["topics"][TOPICS.tasks.name]["messages"] == 20

        down = json.loads(cli(env, "down", "--json"))
        assert down["stopped_broker"] and set(down["stopped_services"]) == set(up["services"])
        assert not json.loads(subprocess.run([sys.executable, "-m", "forge_stream", "status", "--json"], env=env,
                                             capture_output=True, text=True).stdout)["reachable"]

        again = subprocess.run([sys.executable, "-m", "forge_stream", "up"], env=env, capture_output=True, text=True,
                               timeout=180)  # as a newcomer reads it, piped (not a terminal: no 80-column wrap)
        assert again.returncode == 0, again.stderr[-3000:]
        lines = again.stderr.splitlines()
        assert any(line.startswith("forge-stream is up: Kafka at " + bootstrap) for line in lines), lines
        for name in up["services"]:  # each service on one line, its log's path whole (copyable)
            log = tmp_path / "home" / "run" / f"{name}.log"
            assert any(line.lstrip().startswith(name) and line.endswith(f"log {log}") for line in lines), lines
        assert any("`forge-stream logs`" in line for line in lines), lines
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "after-restart",
                             "auto.offset.reset": "earliest"})
        consumer.subscribe([TOPICS.tasks.name])
        got = []
        deadline = time.monotonic() + 60
        while len(got) < len(sent) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and not msg.error():
                got.append(decode(msg.value())[1])
        consumer.close()
        assert sorted(got, key=lambda r: r["seq"]) == sent
        assert encode("Task", got[0])  # still valid events
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)


def test_up_with_external_bootstrap_starts_no_broker(kafka_bootstrap, tmp_path):
    topology = tmp_path / "registry-only.yaml"
    topology.write_text("name: registry-only\nservices:\n  - registry\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_REGISTRY_PORT=str(free_port()))
    try:
        up = json.loads(cli(env, "up", str(topology), "--bootstrap-servers", kafka_bootstrap, "--json"))
        assert up["bootstrap_servers"] == kafka_bootstrap and not up["embedded_broker"]
        assert set(up["topics"].values()) == {"exists"}  # `topics create` is idempotent
        assert not (tmp_path / "home" / "kafka").exists()
        status = json.loads(cli(env, "status", "--bootstrap-servers", kafka_bootstrap, "--json"))
        assert status["reachable"] and status["services"]["registry"]["healthy"]
    finally:
        down = json.loads(cli(env, "down", "--bootstrap-servers", kafka_bootstrap, "--json"))
    assert down == {"stopped_services": ["registry"], "stopped_broker": False}


def _own_ports(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(tmp_path / "home"), FORGE_KAFKA_PORT=str(free_port()),
               FORGE_KAFKA_CONTROLLER_PORT=str(free_port()), FORGE_REGISTRY_PORT=str(free_port()))
    return env


def test_down_leaves_alone_an_unrelated_process_named_by_a_stale_broker_pid_file(tmp_path):
    """The broker is gone, its pid file stayed, and the pid now belongs to another program: `down` must not signal
    it (it checks the process's command line, as the supervisor does for its own pid file)."""
    env = _own_ports(tmp_path)
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        pid_file = tmp_path / "home" / "kafka" / "broker.pid"
        pid_file.parent.mkdir(parents=True)
        pid_file.write_text(str(bystander.pid))
        down = json.loads(cli(env, "down", "--json"))
        assert down == {"stopped_services": [], "stopped_broker": False}
        time.sleep(0.5)
        assert bystander.poll() is None, f"down signalled an unrelated process ({bystander.returncode})"
    finally:
        bystander.kill()
        bystander.wait()


def answers(bootstrap: str) -> bool:
    """Whether the broker answers, partition leaders included (not while it recovers its logs)."""
    try:
        return describe(bootstrap)["reachable"]
    except KafkaException:
        return False


def test_a_killed_embedded_broker_is_restarted_by_the_supervisor_and_the_pipeline_goes_on(tmp_path):
    env = _own_ports(tmp_path)
    topology = tmp_path / "processors-only.yaml"
    topology.write_text("name: processors-only\nservices:\n  - processors\n")
    run = f"brk{time.monotonic_ns()}"

    def produce_group(name: str) -> str:
        group = f"{run}-{name}"
        producer = EventProducer(bootstrap)
        for schema, record in group_events(group, group_size=2, turns=2, start_ms=int(time.time() * 1000)):
            producer.send_sync({"Task": TOPICS.tasks, "SessionStarted": TOPICS.sessions,
                                "SessionFinished": TOPICS.sessions, "Completion": TOPICS.completions,
                                "ToolSpan": TOPICS.tool_spans, "Reward": TOPICS.rewards}[schema], group, record,
                               schema)
        producer.close()
        return group

    def sampled(group: str) -> bool:
        try:
            return bool(read_events(bootstrap, TOPICS.samples, lambda r: r["group_id"] == group))
        except Exception:  # the broker is still coming back
            return False

    try:
        up = json.loads(cli(env, "up", str(topology), "--json"))
        bootstrap = up["bootstrap_servers"]
        broker = json.loads(cli(env, "status", "--json"))["services"]["broker"]
        assert broker["state"] == "running" and broker["restarts"] == 0
        before = produce_group("before")
        until(lambda: sampled(before), 180, "a sample before the broker is killed")

        os.kill(broker["pid"], signal.SIGKILL)
        services = Supervisor(tmp_path / "home" / "run")  # `status` itself exits 1 while Kafka is unreachable
        back = until(lambda: (b := services.status()["broker"])["restarts"] == 1 and b["state"] == "running" and b,
                     60, "the supervisor restarted the broker")
        assert back["last_exit"]["reason"] == "killed by SIGKILL" and back["pid"] != broker["pid"]
        assert (tmp_path / "home" / "kafka" / "broker.pid").read_text() == str(back["pid"])
        until(lambda: answers(bootstrap), 120, "the restarted broker answers")  # a JVM start, then log recovery
        after = produce_group("after")  # through the restarted broker, to the processors that kept running
        until(lambda: sampled(after), 300, lambda: "a sample after the broker came back; the processors' log ends:\n"
              + "\n".join((tmp_path / "home" / "run" / "processors.log").read_text().splitlines()[-40:]))
        assert services.status()["processors"]["state"] == "running"  # (restarted, if losing Kafka ended it)

        down = json.loads(cli(env, "down", "--json"))
        assert down == {"stopped_services": ["processors"], "stopped_broker": True}
        assert not _alive(back["pid"])
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)


def test_a_second_up_says_what_already_runs_and_starts_only_the_rest(tmp_path):
    env = _own_ports(tmp_path)
    registry = tmp_path / "registry-only.yaml"
    registry.write_text("name: registry-only\nservices:\n  - registry\n")

    def up() -> list[str]:
        done = subprocess.run([sys.executable, "-m", "forge_stream", "up", str(registry)], env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr.splitlines()

    try:
        first = up()
        assert any(line.startswith("Starting the embedded Kafka broker") for line in first), first
        assert "Starting registry..." in first
        running = Supervisor(tmp_path / "home" / "run").status()
        again = up()
        assert not any(line.startswith("Starting") for line in again), again
        assert f"The embedded Kafka broker already runs (pid {running['broker']['pid']})." in again
        assert f"registry already runs (pid {running['registry']['pid']})." in again

        Supervisor(tmp_path / "home" / "run").stop("registry")
        third = up()
        assert "Starting registry..." in third and not any("Starting the embedded" in line for line in third), third

        broker_log = subprocess.run([sys.executable, "-m", "forge_stream", "logs", "broker", "-n", "200"], env=env,
                                    capture_output=True, text=True, timeout=60)
        assert broker_log.returncode == 0, broker_log.stderr  # the broker's log, by the name `status` gives it
        shown = broker_log.stdout.splitlines()
        assert shown and shown == (tmp_path / "home" / "run" / "broker.log").read_text().splitlines()[-len(shown):]
    finally:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=env, capture_output=True, timeout=120)
