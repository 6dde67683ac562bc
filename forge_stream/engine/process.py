"""Start and stop a local engine as a separate server process (used by tests, the gateway's tests and `up`)."""

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from forge_stream.kafka.broker import free_port


@dataclass
class EngineProcess:
    """`python -m forge_stream.engine serve` on a free port; `start()` returns once /health answers."""

    model: str
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    _proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> "EngineProcess":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "forge_stream.engine", "serve", "--model", self.model,
             "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"engine exited with code {self._proc.returncode} (log: {self.log_path})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"engine on port {self.port} not healthy after {timeout}s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
