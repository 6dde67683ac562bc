"""Background services of a deployment (registry, engine, gateway, processors, trainer...): start, supervise,
stop, list.

Each home has one supervisor: a small detached process (`python -m forge_stream.services RUN_DIR`, pid in
`supervisor.pid`) that spawns every service in its own session, with its log under the run directory, and
restarts one that dies, after a backoff that doubles on each quick death (1 s, 2 s, 4 s... capped at a minute).
A service is its whole process group: when its process dies, what it started (a gateway's workers) is ended too
before it is started again, and stopping a service waits for its whole group.
Its parent-of-all position is what lets it record how a service ended (exit code or signal, and its log's tail).

`services.json` is the shared state, read and written under a file lock: the command line (`up`, `down`,
`status`, from any shell) adds and removes services there; the supervisor spawns, watches and records. A service
that is removed is never restarted, so `stop` removes it first and then ends it; `stop_all` (`down`) also ends
the supervisor before the services. A service that keeps dying within `QUICK_EXIT_S` of its start is
crash-looping, and `status` says so rather than calling it healthy.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from forge_stream.proc import (ProcessError, ProcessExited, alive, exit_reason, log_tail, start_process,
                               wait_healthy)

RESTART_BASE_S = 1.0
RESTART_CAP_S = 60.0
QUICK_EXIT_S = 10.0  # a service that dies sooner than this after its start died quickly
CRASH_LOOP_EXITS = 3  # quick deaths in a row that make a service crash-looping
ORPHAN_GRACE_S = 5.0  # how long the children a dead service left get after SIGTERM, before SIGKILL
TICK_S = 0.3


class ServiceError(ProcessError):
    """A service did not start or become healthy; the message names its log."""


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    argv: list[str]
    health_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None  # what to print for people
    start_timeout_s: float = 120.0  # how long `up` waits for it to be healthy
    pid_file: str | None = None  # where the supervisor writes the pid of each process it starts for it

    @classmethod
    def python(cls, name: str, module: str, *args: str, **kw) -> "ServiceSpec":
        return cls(name, [sys.executable, "-m", module, *args], **kw)


def _parent_of(pid: int) -> int | None:
    """The parent pid of a live process (Linux /proc), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def _restart_delay(quick_exits: int) -> float:
    return min(RESTART_CAP_S, RESTART_BASE_S * 2 ** max(0, quick_exits - 1))


def _group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid` (Linux /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _end(pid: int, timeout: float) -> None:
    """SIGTERM the process group of `pid` (a service's session: the service and every child it started), SIGKILL
    what is left of it after `timeout`. Waits for the whole group, not only `pid`: a child that outlives its parent
    (a gateway worker holding its SO_REUSEPORT socket) would go on serving beside the service's next start."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while (alive(pid) or _group(pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 5.0  # SIGKILL is sent, not yet done: the kernel tears the processes down
    while (alive(pid) or _group(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)


class Supervisor:
    """The command line's side of one run directory's services (the watching is `supervise`'s)."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.state_file = run_dir / "services.json"
        self.lock_file = run_dir / "services.lock"
        self.pid_file = run_dir / "supervisor.pid"
        self.log_file = run_dir / "supervisor.log"

    def _state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return {}

    def names(self) -> list[str]:
        """The services of the deployment, in the order they were started."""
        return list(self._state())

    @contextmanager
    def locked(self):
        """The state, under the lock; what the block leaves in it is saved."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.lock_file, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            state = self._state()
            yield state
            tmp = self.state_file.with_suffix(".tmp")
            tmp.unlink(missing_ok=True)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
                out.write(json.dumps(state, indent=2))  # 0600: the services' environments hold the deployment's tokens
            os.replace(tmp, self.state_file)

    def daemon_pid(self) -> int | None:
        """The supervisor process's pid, if it runs."""
        try:
            pid = int(self.pid_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not alive(pid):
            return None
        try:
            if b"forge_stream.services" not in Path(f"/proc/{pid}/cmdline").read_bytes() \
                    and _parent_of(pid) != os.getpid():
                return None  # the pid was reused (a child of ours is the supervisor between its fork and its exec)
        except FileNotFoundError:
            pass
        return pid

    def write_pid(self, pid: int) -> None:
        """Replace the pid file in one step: a reader never sees it empty (it would take the supervisor for dead)."""
        tmp = self.pid_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(str(pid))
        os.replace(tmp, self.pid_file)

    def ensure_daemon(self) -> int:
        with self.locked():
            pid = self.daemon_pid()
            if pid is not None:
                return pid
            daemon = start_process([sys.executable, "-m", "forge_stream.services", str(self.run_dir)], self.log_file,
                                   new_session=True)
            self.write_pid(daemon.pid)
            return daemon.pid

    def start(self, spec: ServiceSpec, timeout: float | None = None) -> dict:
        """Have the supervisor run `spec` (unless it already runs) and wait until it is healthy (at most `timeout`,
        by default the spec's `start_timeout_s`)."""
        return self.start_together([spec], timeout)[spec.name]

    def start_together(self, specs: list[ServiceSpec], timeout: float | None = None) -> dict[str, dict]:
        """`start` for several services at once (engine replicas): all are spawned first, then each is waited for,
        so their start-ups overlap instead of adding up."""
        entries, new = {}, []
        with self.locked() as state:
            for spec in specs:
                current = state.get(spec.name)
                if current and alive(current.get("pid")):
                    entries[spec.name] = current
                    continue
                new.append(spec)
                state[spec.name] = {
                    "argv": spec.argv, "env": spec.env, "log": str(self.run_dir / f"{spec.name}.log"),
                    "url": spec.url, "health_url": spec.health_url, "pid": None, "started": None,
                    "next_start": 0.0, "restarts": 0, "quick_exits": 0, "last_exit": None,
                    "pid_file": spec.pid_file,
                }
        self.ensure_daemon()
        for spec in new:
            entry = entries[spec.name] = self._wait_spawned(spec.name)
            self._wait_healthy(spec, entry["pid"], Path(entry["log"]),
                               spec.start_timeout_s if timeout is None else timeout)
        return entries

    def _wait_spawned(self, name: str, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self._state().get(name)
            if entry is None:
                raise ServiceError(f"{name} was stopped while it started")
            if entry["pid"] is not None:
                return entry
            if entry["last_exit"] is not None:  # it could not even be spawned
                self.stop(name)
                raise ServiceError(f"{name} did not start: {entry['last_exit']['reason']}")
            if self.daemon_pid() is None:
                raise ServiceError(f"the supervisor of {self.run_dir} is not running; its log {self.log_file} "
                                   f"ends:\n{log_tail(self.log_file)}")
            time.sleep(0.1)
        raise ServiceError(f"the supervisor did not start {name} within {timeout:.0f}s; see {self.log_file}")

    def _wait_healthy(self, spec: ServiceSpec, pid: int, log: Path, timeout: float) -> None:
        def exited() -> str | None:
            entry = self._state().get(spec.name)
            if entry is None or entry["pid"] != pid or not alive(pid):
                return ((entry or {}).get("last_exit") or {"reason": "it exited"})["reason"]
            return None

        try:
            wait_healthy(spec.name, url=spec.health_url, exited=exited, log=log, timeout=timeout,
                              any_answer=True, interval=0.3)
        except ProcessExited as exc:
            self.stop(spec.name)
            raise ServiceError(str(exc)) from None
        except ProcessError as exc:
            raise ServiceError(str(exc)) from None

    def stop(self, name: str, timeout: float = 20.0) -> bool:
        """Take `name` off the supervisor's list (so it is not restarted), then end it; whether it ran."""
        with self.locked() as state:
            entry = state.pop(name, None)
        if entry is None or not alive(entry.get("pid")):
            return False
        _end(entry["pid"], timeout)
        return True

    def stop_daemon(self, timeout: float = 10.0) -> bool:
        pid = self.daemon_pid()
        if pid is None:
            return False
        _end(pid, timeout)
        self.pid_file.unlink(missing_ok=True)
        return True

    def stop_all(self) -> list[str]:
        """The supervisor first (it would restart what is stopped), then the services, last started first."""
        self.stop_daemon()
        names = list(self._state())
        return [name for name in reversed(names) if self.stop(name)]

    def status(self) -> dict:
        """Per service: state (running, starting, unhealthy, restarting, crash-looping, dead), pid, restarts, last exit."""
        supervised = self.daemon_pid() is not None
        now = time.time()
        out = {}
        for name, entry in self._state().items():
            running = alive(entry["pid"])
            crash_looping = entry["quick_exits"] >= CRASH_LOOP_EXITS and not (
                running and now - entry["started"] >= QUICK_EXIT_S)
            if crash_looping:
                state = "crash-looping"
            elif running:
                state = "running"
                if entry.get("health_url"):
                    state = _health_state(entry["health_url"])
            else:
                state = "restarting" if supervised else "dead"
            out[name] = {**entry, "state": state, "running": running, "healthy": state == "running",
                         "supervised": supervised}
        return out


def _health_state(url: str) -> str:
    """running, or starting (a 503 whose body says so: vLLM's start-up), or unhealthy."""
    try:
        response = httpx.get(url, timeout=2)
    except httpx.HTTPError:
        return "unhealthy"
    if response.status_code < 500:
        return "running"
    try:
        starting = response.status_code == 503 and response.json().get("status") == "starting"
        return "starting" if starting else "unhealthy"
    except ValueError:
        return "unhealthy"


# a service writes to a log file: no progress bars there (transformers drew one per checkpoint saved or loaded)
_LOG_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def _spawn(entry: dict, now: float) -> subprocess.Popen | None:
    try:
        with open(entry["log"], "ab") as log:
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} forge-stream supervisor: starting "
                      f"(restart {entry['restarts'] + 1 if entry['last_exit'] else 0})\n".encode())
            log.flush()
            return start_process(entry["argv"], log, new_session=True, env={**os.environ, **_LOG_ENV, **entry["env"]})
    except OSError as exc:
        entry["quick_exits"] += 1
        entry["last_exit"] = {"reason": f"could not start: {exc}", "at": now, "ran_s": 0.0, "log_tail": ""}
        entry["next_start"] = now + _restart_delay(entry["quick_exits"])
        return None


def _tick(state: dict, children: dict[str, subprocess.Popen]) -> None:
    """One look at every service: record the ones that ended, (re)start the ones that are due."""
    now = time.time()
    for name, proc in list(children.items()):  # reap what was stopped through the command line
        if (name not in state or state[name]["pid"] != proc.pid) and proc.poll() is not None:
            del children[name]
    for name, entry in state.items():
        pid = entry["pid"]
        if pid is not None:
            proc = children.get(name)
            if proc is not None and proc.pid == pid:
                if proc.poll() is None:
                    continue
                reason, code = exit_reason(proc.returncode), proc.returncode
                del children[name]
            elif alive(pid):
                continue
            else:  # started by an earlier supervisor: only the parent learns how a process ended
                reason, code = "ended (not a child of this supervisor, so its exit status is unknown)", None
            left = _group(pid)  # its children: ended with it, or they would serve beside its next start
            if left:
                print(f"{time.strftime('%H:%M:%S')} {name}: ending {len(left)} process(es) it left in its process "
                      f"group ({', '.join(map(str, left))})", flush=True)
                _end(pid, ORPHAN_GRACE_S)
            ran = now - entry["started"]
            entry["quick_exits"] = entry["quick_exits"] + 1 if ran < QUICK_EXIT_S else 0
            entry["last_exit"] = {"reason": reason, "code": code, "at": now, "ran_s": round(ran, 2),
                                  "log_tail": log_tail(Path(entry["log"]))}
            entry["pid"] = None
            entry["next_start"] = now + _restart_delay(entry["quick_exits"])
            print(f"{time.strftime('%H:%M:%S')} {name} {reason} after {ran:.1f}s; restarting in "
                  f"{entry['next_start'] - now:.0f}s", flush=True)
        elif now >= entry["next_start"]:
            proc = _spawn(entry, now)
            if proc is None:
                continue
            if entry["last_exit"] is not None:
                entry["restarts"] += 1
            entry["pid"], entry["started"] = proc.pid, now
            children[name] = proc
            if entry.get("pid_file"):  # e.g. the embedded broker's, which `down` and its tooling read
                Path(entry["pid_file"]).write_text(str(proc.pid))


def supervise(run_dir: Path) -> None:
    """The supervisor process: watch the run directory's services until SIGTERM (or the directory is gone)."""
    supervisor = Supervisor(run_dir)
    with open(run_dir / "supervisor.lock", "a") as single:
        try:
            fcntl.flock(single, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another supervisor watches {run_dir}", flush=True)
            return
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
        supervisor.write_pid(os.getpid())
        print(f"{time.strftime('%H:%M:%S')} supervising the services of {run_dir} (pid {os.getpid()})", flush=True)
        children: dict[str, subprocess.Popen] = {}
        while not stopping and run_dir.is_dir():
            with supervisor.locked() as state:
                _tick(state, children)
            time.sleep(TICK_S)
        print(f"{time.strftime('%H:%M:%S')} supervisor stopping; the services keep running", flush=True)


if __name__ == "__main__":
    supervise(Path(sys.argv[1]))


__all__ = ["ServiceError", "ServiceSpec", "Supervisor", "exit_reason", "supervise"]
