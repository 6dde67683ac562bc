"""Settings: one frozen object per process role, built at the entry point from flags, env (FORGE_*) and defaults.

Nothing below the entry points reads the environment; code receives these objects.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from forge_stream.topics import Replication

KAFKA_FIELDS = ("bootstrap_servers", "kafka_port", "kafka_controller_port")  # which Kafka `up` records
REPLICATION_FIELDS = ("replication_factor", "min_insync_replicas")  # and how its topics are replicated


class ForgeSettings(BaseSettings):
    """Where things live and how to reach Kafka. Env: FORGE_HOME, FORGE_BOOTSTRAP_SERVERS, ..."""

    model_config = SettingsConfigDict(env_prefix="FORGE_", frozen=True)

    home: Path = Path.home() / ".forge-stream"
    cache_dir: Path = Path.home() / ".cache" / "forge-stream"
    bootstrap_servers: str | None = None  # None: run the embedded local broker
    kafka_port: int = 9092
    kafka_controller_port: int = 9093
    kafka_heap: str = "512m"
    replication_factor: int = 1  # the deployment's, from its topology (`up` passes it on): checked on every topic
    min_insync_replicas: int = 1  # acks=all waits for this many replicas (the topics' min.insync.replicas)
    registry_port: int = 8081
    gateway_port: int = 8000
    engine_port: int = 8100  # the first engine's; a topology's further engine replicas take the ports after it
    kv_tier_port: int = 6555  # the shared KV tier's LMCache server (engines attach here)
    kv_tier_http_port: int = 6580  # and its admin API (health, L1 use, lookups and hits), loopback only

    @property
    def broker_dir(self) -> Path:
        return self.home / "kafka"

    @property
    def model_dir(self) -> Path:
        """The initial policy for the embedded default (a tiny model `up` writes if missing)."""
        return self.home / "model"

    @property
    def checkpoint_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def replication(self) -> Replication:
        return Replication(self.replication_factor, self.min_insync_replicas)

    @property
    def bootstrap(self) -> str:
        return self.bootstrap_servers or f"127.0.0.1:{self.kafka_port}"

    @property
    def embedded(self) -> bool:
        return self.bootstrap_servers is None

    @property
    def deployment_file(self) -> Path:
        """Which Kafka `forge-stream up` last ran this home's services on (written by `up`)."""
        return self.run_dir / "kafka.json"

    def record_deployment(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        recorded = {k: getattr(self, k) for k in KAFKA_FIELDS + REPLICATION_FIELDS}
        self.deployment_file.write_text(json.dumps(recorded))

    def as_deployed(self) -> "ForgeSettings":
        """These settings with the Kafka that `up` last used in this home (its embedded broker's ports, or its
        external cluster; and its replication, unless set here), so a later command from a shell without the same
        FORGE_* variables addresses the running deployment instead of the default port; unchanged if `up` never ran
        here."""
        try:
            recorded = json.loads(self.deployment_file.read_text())
        except (FileNotFoundError, ValueError):
            return self
        return self.model_copy(update={k: recorded[k] for k in KAFKA_FIELDS + REPLICATION_FIELDS
                                       if k in recorded and k not in self.model_fields_set})
