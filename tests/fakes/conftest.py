"""Fixtures that run the fakes of outer systems as real server processes (fake `vllm serve`)."""

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forge_stream.engine.process import free_port
from forge_stream.engine.tiny import TinyModelSpec, init_tiny_model

FAKE_VLLM = Path(__file__).with_name("vllm_server.py")
TOOL_REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fake_tiny") / "model"
    init_tiny_model(out, TinyModelSpec(seed=0))
    return out


@pytest.fixture(scope="session")
def fake_vllm_url(fake_model_dir):
    """A fake vLLM server replying "Hello there, agent." then the tool-call reply, alternately."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE_VLLM), "--model", str(fake_model_dir), "--port", str(port),
                             "--reply", "Hello there, agent.", "--reply", TOOL_REPLY])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=15)


@pytest.fixture(scope="session")
def fake_vllm_module():
    """The fake server's module (for its `fake_logprob` rule), loaded from its file."""
    spec = importlib.util.spec_from_file_location("fake_vllm_server", FAKE_VLLM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
