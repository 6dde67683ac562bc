"""Start and stop a rollout engine as a separate server process (used by tests and benchmarks): the local torch
engine (`engine serve`) or real vLLM behind forge-stream's engine protocol (`engine vllm`)."""

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from forge_stream import proc
from forge_stream.kafka.broker import free_port


@dataclass
class EngineProcess:
    """`python -m forge_stream.engine serve` (or `vllm`, with `kind`) on a free port; `start()` returns once /health
    answers (vLLM: after its start-up, about two minutes on 2 cores, longer while its runtime installs)."""

    model: str
    port: int = field(default_factory=free_port)
    extra_args: tuple[str, ...] = ()
    log_path: Path | None = None
    kind: str = "serve"
    _proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float | None = None) -> "EngineProcess":
        return self.spawn().wait(timeout)

    def spawn(self) -> "EngineProcess":
        """Start the process without waiting for it (`wait` does): several engines' start-ups then overlap."""
        self._proc = proc.start_process([sys.executable, "-m", "forge_stream.engine", self.kind, "--model", self.model,
                                         "--port", str(self.port), *self.extra_args],
                                        self.log_path or subprocess.DEVNULL)
        return self

    def wait(self, timeout: float | None = None) -> "EngineProcess":
        """Return once the engine answers /health (stopped, and the error raised, if it does not)."""
        timeout = timeout or (120.0 if self.kind == "serve" else 1200.0)
        try:
            proc.wait_healthy(f"the engine on port {self.port}", self._proc, url=f"{self.url}/health",
                              log=self.log_path, timeout=timeout)
        except proc.ProcessError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self._proc is not None:
            proc.stop(self._proc, 15 if self.kind == "serve" else 60)

    def __enter__(self) -> "EngineProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
