"""Start a process and wait until it is healthy: the one way the package (and its tests) run a server, a worker, the
broker or the supervisor.

`start_process` spawns a command with its output going to a log (a path, appended to; an open file; DEVNULL; or, with
None, wherever the caller's goes), optionally in a session of its own (a signal to its process group reaches its
children, and it outlives the caller's terminal). `wait_healthy` polls until a health URL answers or a check
passes, and fails with `ProcessExited` as soon as the process ends, or `ProcessError` when the time is up; either
message names the log and quotes its tail. `running` starts, waits and, afterwards, `stop`s (SIGTERM, then SIGKILL
after a timeout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import httpx

LOG_TAIL_LINES = 20

Log = Path | IO | int | None


class ProcessError(RuntimeError):
    """A process did not become healthy in time; the message names its log."""


class ProcessExited(ProcessError):
    """A process ended before it was healthy; the message says how and quotes its log's tail."""


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def tail_lines(path: Path, lines: int) -> tuple[list[str], int]:
    """The last `lines` lines of `path` (read backwards in 64 KB blocks, not whole), and the size they end at."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        if lines <= 0:
            return [], end
        at, data = end, b""
        while at > 0 and data.count(b"\n") <= lines:
            step = min(64 * 1024, at)
            at -= step
            f.seek(at)
            data = f.read(step) + data
    return data.decode(errors="replace").splitlines()[-lines:], end


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(tail_lines(path, lines)[0])
    except FileNotFoundError:
        return ""


def alive(pid: int | None) -> bool:
    """Whether process `pid` runs: not gone, not a zombie (ours is reaped), alive if another user's."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a zombie child of ours counts as dead
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done != 0:
            return False
    except ChildProcessError:
        pass
    try:  # so does anyone's zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True


def start_process(argv: list[str], log: Log = None, *, new_session: bool = False, **popen) -> subprocess.Popen:
    """Spawn `argv`, stdout and stderr into `log` (a path is appended to); `popen` goes to subprocess.Popen."""
    if isinstance(log, Path):
        with open(log, "ab") as out:
            return start_process(argv, out, new_session=new_session, **popen)
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                            start_new_session=new_session, **popen)


def wait_healthy(name: str, proc: subprocess.Popen | None = None, *, url: str | None = None,
                 check: Callable[[], bool] | None = None, log: Log = None, timeout: float = 60.0,
                 any_answer: bool = False, exited: Callable[[], str | None] | None = None,
                 interval: float = 0.2) -> None:
    """Return once `url` answers 200 (any status below 500 with `any_answer`) and `check()` passes (each if
    given); without either, once the process is seen running. `exited()` says why the process ended (None while
    it runs); by default `proc`'s exit status."""
    ended = exited or (lambda: None if proc is None or proc.poll() is None else exit_reason(proc.returncode))
    deadline = time.monotonic() + timeout
    while True:
        reason = ended()
        if reason is not None:
            raise ProcessExited(f"{name} did not start ({reason}){_tail_of(log)}")
        if _answers(url, any_answer) and (check is None or check()):
            return
        if time.monotonic() > deadline:
            what = f"at {url} " if url else ""
            raise ProcessError(f"{name} was not healthy {what}within {timeout:.0f}s{_tail_of(log)}")
        time.sleep(interval)


def _tail_of(log: Log) -> str:
    path = log if isinstance(log, Path) else getattr(log, "name", None)
    return f"; its log {path} ends:\n{log_tail(Path(path), 25)}" if isinstance(path, (str, Path)) else ""


def _answers(url: str | None, any_answer: bool) -> bool:
    if url is None:
        return True
    try:
        status = httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return False
    return status < 500 if any_answer else status == 200


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after `timeout`; reaps it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running(argv: list[str], *, name: str | None = None, url: str | None = None,
            check: Callable[[], bool] | None = None, log: Log = None, timeout: float = 60.0,
            stop_timeout: float = 30.0, **popen) -> Iterator[subprocess.Popen]:
    """`start_process` then `wait_healthy`; the process is stopped when the block ends (or waiting failed)."""
    proc = start_process(argv, log, **popen)
    try:
        wait_healthy(name or " ".join(map(str, argv[:4])), proc, url=url, check=check, log=log, timeout=timeout)
        yield proc
    finally:
        stop(proc, stop_timeout)
