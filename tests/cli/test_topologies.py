"""Shipped topologies: every flag a service builder passes is one its command takes (and every service that can wait
for Kafka is told to), a topology across hosts (topologies/cluster.yaml) places each service where it says, which
`forge-stream up --dry-run` prints, and each topology's replication reaches every service it starts."""

import json
import subprocess
import sys

import pytest
import typer.main

from forge_stream.cli import app
from forge_stream.deploy import TOPOLOGY_DIR, load_topology, plan, up
from forge_stream.settings import ForgeSettings
from forge_stream.topics import EMBEDDED, Replication

# the default gateway port, stated: .ci/run sets FORGE_GATEWAY_PORT, which ForgeSettings would take
SETTINGS = ForgeSettings(bootstrap_servers="127.0.0.1:1234", gateway_port=8000)


def _command(argv: list[str]):
    """The click command a service's argv runs (`python -m forge_stream[.engine] GROUP... CMD --flags`)."""
    assert argv[1] == "-m" and argv[2] in ("forge_stream", "forge_stream.engine"), argv
    command = typer.main.get_command(app)
    words = (["engine"] if argv[2] == "forge_stream.engine" else []) + argv[3:]
    for word in words:
        if word.startswith("-") or not hasattr(command, "commands"):
            break
        command = command.commands[word]
    return command


@pytest.mark.parametrize("name", sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml")))
def test_every_flag_a_topology_passes_is_taken_by_its_command(name):
    topology = load_topology(name)
    hosts = [None, *dict.fromkeys(h for hs in topology.hosts.values() for h in hs)]
    placements = [p for host in hosts for p in plan(SETTINGS, topology, host)]
    assert {p.spec.name for p in placements} == set(topology.services)
    for placement in placements:
        argv = placement.spec.argv
        if argv[2] in ("uvicorn", "lmcache.cli.main"):  # LMCache's own flags: tests/test_kvtier.py
            continue
        command = _command(argv)
        flags = {opt for param in command.params for opt in param.opts}
        passed = {word.split("=", 1)[0] for word in argv if word.startswith("--")}
        assert passed <= flags, f"{name}/{placement.spec.name}: {sorted(passed - flags)} not taken by the command"
        if "--wait-for-kafka" in flags:  # under the supervisor a service (re)started while Kafka is away waits for it
            assert "--wait-for-kafka" in passed, f"{name}/{placement.spec.name} would end while Kafka restarts"


def test_the_cluster_topology_places_each_service_on_its_hosts():
    topology = load_topology("cluster")
    assert topology.bootstrap_servers == "kafka-0:9092,kafka-1:9092,kafka-2:9092"
    # no --bootstrap-servers: the topology's cluster is used, not an embedded broker
    local = ForgeSettings(gateway_port=8000)
    assert plan(local, topology, None) == []  # every service of a cluster is placed on a host
    by_host = {h: [p.spec for p in plan(local, topology, h)]
               for h in ("ctl-0", "lb-0", "gw-0", "gw-1", "gpu-0", "gpu-3", "proc-0", "proc-1", "train-0", "train-1")}
    assert [s.name for s in by_host["ctl-0"]] == ["registry", "controller"]
    for host in ("gpu-0", "gpu-3"):  # real vLLM behind the engine protocol, following run main, on its host's tier
        tier, engine = by_host[host]
        option = dict(zip(engine.argv, engine.argv[1:]))
        assert engine.argv[2:4] == ["forge_stream.engine", "vllm"] and engine.start_timeout_s >= 600
        assert option["--checkpoint-dir"] == "/shared/forge/checkpoints"  # the trainer's store, read from there
        assert (option["--host"], option["--policy-run"], option["--dtype"]) == ("0.0.0.0", "main", "bfloat16")
        assert option["--kv-tier"] == "127.0.0.1:6555"
        assert tier.name == "kv_tier" and tier.argv[2:5] == ["lmcache.cli.main", "server", "--host"]
        l2 = json.loads(tier.argv[tier.argv.index("--l2-adapter") + 1])
        assert l2 == {"type": "resp", "host": "kv-store.internal", "port": 6379, "num_workers": 8}
    assert all([s.name for s in by_host[h]] == ["gateway"] for h in ("gw-0", "gw-1"))
    assert all([s.name for s in by_host[h]] == ["processors"] for h in ("proc-0", "proc-1"))
    for rank, host in enumerate(("train-0", "train-1")):
        (trainer,) = by_host[host]
        option = dict(zip(trainer.argv, trainer.argv[1:]))
        assert (option["--nnodes"], option["--node-rank"], option["--master-addr"]) == ("2", str(rank),
                                                                                       "train-0:29500")
        assert option["--nproc"] == "8" and "--fsdp" in trainer.argv
    for specs in by_host.values():
        for spec in specs:
            if "--bootstrap-servers" in spec.argv:
                assert spec.argv[spec.argv.index("--bootstrap-servers") + 1] == topology.bootstrap_servers
    gateway = by_host["gw-0"][0].argv
    assert gateway.count("--engine") == 4 and gateway[gateway.index("--host") + 1] == "0.0.0.0"
    # each gateway host numbers its sessions' turns under its own ledger; HAProxy sends each session to one host
    assert gateway[gateway.index("--workers") + 1] == "4" and "--shared-sessions" not in gateway
    (balancer,) = by_host["lb-0"]
    option = dict(zip(balancer.argv, balancer.argv[1:]))
    assert balancer.argv[3:5] == ["gateway", "balance"] and (option["--host"], option["--port"]) == ("0.0.0.0", "8000")
    assert [balancer.argv[i + 1] for i, a in enumerate(balancer.argv) if a == "--backend"] == ["gw-0:8000",
                                                                                              "gw-1:8000"]
    with pytest.raises(ValueError, match="places nothing on host 'gpu-9'"):
        up(local, topology, host="gpu-9")


def test_up_dry_run_prints_what_runs_where_and_starts_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "forge_stream", "up", "cluster", "--dry-run", "--json"],
                         capture_output=True, text=True, timeout=120, env={"FORGE_HOME": str(tmp_path),
                                                                          "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["kafka"] == "kafka-0:9092,kafka-1:9092,kafka-2:9092"
    assert sorted(result["hosts"]) == ["ctl-0", "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gw-0", "gw-1", "lb-0", "proc-0",
                                       "proc-1",
                                       "train-0", "train-1"]
    assert "--node-rank 1" in result["hosts"]["train-1"][0]["command"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "kafka").exists()  # nothing started
    text = subprocess.run([sys.executable, "-m", "forge_stream", "up", "local", "--dry-run"], capture_output=True,
                          text=True, timeout=120, env={"FORGE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert text.returncode == 0 and "embedded broker" in text.stdout and "(this machine)" in text.stdout
    assert [line.split()[0] for line in text.stdout.splitlines() if line.startswith("  ")] == [
        "registry", "engine", "gateway", "processors", "trainer"]


def test_a_topology_states_its_replication_and_every_service_is_told_it(tmp_path):
    expected = {"local": EMBEDDED, "learn": EMBEDDED, "infra": EMBEDDED, "cluster": Replication(3, 2)}
    for name, replication in expected.items():
        topology = load_topology(name)
        assert topology.replication == replication, name
        assert topology.settings_for(SETTINGS).replication == replication
        hosts = [None, *dict.fromkeys(h for hs in topology.hosts.values() for h in hs)]
        for placement in (p for host in hosts for p in plan(SETTINGS, topology, host)):
            env = placement.spec.env
            assert (env["FORGE_REPLICATION_FACTOR"], env["FORGE_MIN_INSYNC_REPLICAS"]) == (
                str(replication.factor), str(replication.min_insync)), (name, placement.spec.name)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("name: wrong\nkafka:\n  replication_factor: 2\n  min_insync_replicas: 3\nservices: [registry]\n")
    with pytest.raises(ValueError, match="wrong.yaml: kafka: min.insync.replicas 3 must be between 1 and the "
                                         "replication factor 2"):
        load_topology(str(wrong))


def test_a_load_balancer_on_a_gateway_s_host_needs_a_port_of_its_own(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("name: two\nservices:\n  - gateway: {hosts: [gw-0, gw-1], port: 8000}\n"
                    "  - load_balancer: {host: gw-0}\n")
    with pytest.raises(ValueError, match="give the load balancer another `port:`"):
        plan(SETTINGS, load_topology(str(path)), "gw-0")
    path.write_text(path.read_text().replace("{host: gw-0}", "{host: gw-0, port: 8080}"))
    (balancer,) = [p.spec for p in plan(SETTINGS, load_topology(str(path)), "gw-0") if p.spec.name == "load_balancer"]
    assert balancer.argv[balancer.argv.index("--port") + 1] == "8080"
    assert [balancer.argv[i + 1] for i, a in enumerate(balancer.argv) if a == "--backend"] == ["gw-0:8000",
                                                                                              "gw-1:8000"]
