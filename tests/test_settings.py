"""Which Kafka a command addresses, and the replication it checks the topics for: its flag, then FORGE_* variables,
then what `up` last ran the home on."""

import pytest

from forge_stream.cli.options import settings
from forge_stream.settings import ForgeSettings


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("FORGE_BOOTSTRAP_SERVERS", "FORGE_KAFKA_PORT", "FORGE_KAFKA_CONTROLLER_PORT",
                 "FORGE_REPLICATION_FACTOR", "FORGE_MIN_INSYNC_REPLICAS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FORGE_HOME", str(tmp_path))
    return tmp_path


def test_without_a_deployment_the_default_port(home):
    assert settings().bootstrap == "127.0.0.1:9092" and settings().embedded


def test_a_command_finds_the_embedded_broker_up_started_on_another_port(home, monkeypatch):
    ForgeSettings(kafka_port=19092, kafka_controller_port=19093).record_deployment()
    cfg = settings()
    assert (cfg.bootstrap, cfg.kafka_controller_port, cfg.embedded) == ("127.0.0.1:19092", 19093, True)
    assert settings("broker:9092").bootstrap == "broker:9092"  # the flag wins
    monkeypatch.setenv("FORGE_KAFKA_PORT", "29092")
    assert settings().bootstrap == "127.0.0.1:29092"  # and so does the environment


def test_a_command_finds_the_external_cluster_up_ran_on(home, monkeypatch):
    ForgeSettings(bootstrap_servers="k1:9092,k2:9092", replication_factor=3, min_insync_replicas=2).record_deployment()
    assert settings().bootstrap == "k1:9092,k2:9092" and not settings().embedded
    assert (settings().replication.factor, settings().replication.min_insync) == (3, 2)  # its topics are checked so
    monkeypatch.setenv("FORGE_MIN_INSYNC_REPLICAS", "3")
    assert (settings().replication.factor, settings().replication.min_insync) == (3, 3)  # the environment wins


def test_an_unreadable_record_is_ignored(home):
    cfg = ForgeSettings()
    cfg.run_dir.mkdir(parents=True)
    cfg.deployment_file.write_text("{not json")
    assert settings().bootstrap == "127.0.0.1:9092"
