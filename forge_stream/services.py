"""Background services of a deployment (registry, engine, gateway, processors, trainer...): start, stop, list.

Each service is a real process started in its own session with its log and pid file under the run directory,
so `forge-stream down` and `status` find them from any shell. Health is an HTTP URL or the process being alive.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


class ServiceError(RuntimeError):
    """A service did not start or become healthy; the message names its log."""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # what to print for people

    @classmethod
    def python(cls, name: str, module: str, *args: str, **kw) -> "ServiceSpec":
        return cls(name, [sys.executable, "-m", module, *args], **kw)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as dead
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


class Supervisor:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.state_file = run_dir / "services.json"

    def _state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}

    def _save(self, state: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(state, indent=2))

    def start(self, spec: ServiceSpec, timeout: float = 120.0) -> dict:
        state = self._state()
        current = state.get(spec.name)
        if current and _alive(current["pid"]):
            return current
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / f"{spec.name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **spec.env}, start_new_session=True)
        entry = {"pid": proc.pid, "log": str(log_path), "url": spec.url, "health_url": spec.health_url,
                 "argv": spec.argv, "started": time.time()}
        state[spec.name] = entry
        self._save(state)
        self._wait_healthy(spec, proc, log_path, timeout)
        return entry

    def _wait_healthy(self, spec: ServiceSpec, proc: subprocess.Popen, log: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
                raise ServiceError(f"{spec.name} exited with {proc.returncode}; its log {log} ends:\n{tail}")
            if spec.health_url is None:
                return
            try:
                if httpx.get(spec.health_url, timeout=2).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ServiceError(f"{spec.name} was not healthy at {spec.health_url} within {timeout:.0f}s; see {log}")

    def stop(self, name: str, timeout: float = 20.0) -> bool:
        state = self._state()
        entry = state.pop(name, None)
        self._save(state)
        if entry is None or not _alive(entry["pid"]):
            return False
        os.killpg(entry["pid"], signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(entry["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(entry["pid"]):
            os.killpg(entry["pid"], signal.SIGKILL)
        return True

    def stop_all(self) -> list[str]:
        names = list(self._state())
        return [name for name in reversed(names) if self.stop(name)]

    def status(self) -> dict:
        out = {}
        for name, entry in self._state().items():
            healthy = _alive(entry["pid"])
            if healthy and entry.get("health_url"):
                try:
                    healthy = httpx.get(entry["health_url"], timeout=2).status_code < 500
                except httpx.HTTPError:
                    healthy = False
            out[name] = {**entry, "running": _alive(entry["pid"]), "healthy": healthy}
        return out


__all__ = ["ServiceError", "ServiceSpec", "Supervisor"]
