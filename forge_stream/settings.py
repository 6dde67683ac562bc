"""Settings: one frozen object per process role, built at the entry point from flags, env (FORGE_*) and defaults.

Nothing below the entry points reads the environment; code receives these objects.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class ForgeSettings(BaseSettings):
    """Where things live and how to reach Kafka. Env: FORGE_HOME, FORGE_BOOTSTRAP_SERVERS, ..."""

    model_config = SettingsConfigDict(env_prefix="FORGE_", frozen=True)

    home: Path = Path.home() / ".forge-stream"
    cache_dir: Path = Path.home() / ".cache" / "forge-stream"
    bootstrap_servers: str | None = None  # None: run the embedded local broker
    kafka_port: int = 9092
    kafka_controller_port: int = 9093
    kafka_heap: str = "512m"
    registry_port: int = 8081
    gateway_port: int = 8000
    engine_port: int = 8100

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
    def bootstrap(self) -> str:
        return self.bootstrap_servers or f"127.0.0.1:{self.kafka_port}"

    @property
    def embedded(self) -> bool:
        return self.bootstrap_servers is None
