"""Who recorded for which session, among the processes of one `gateway serve --workers N` (one host).

The workers share a port, and the kernel hands each connection to any of them, so one session's calls reach
several workers. A worker holding a session must know, before serving a call, whether another worker recorded for
it since (then it rebuilds the session from its events on Kafka, as on a miss). Across hosts, that takes a
following of Kafka (`--shared-sessions`: forge_stream.kafka.sessionlog, an end-offsets lookup per call and a tail
of every record). On one host the workers can tell each other directly, in a file they all map into memory:

    pids      N slots of 8 bytes: the pid of the worker that holds each slot (0: free)
    counters  BUCKETS x N counters of 4 bytes: how many times worker j recorded for a session of bucket b

A worker bumps its own counter of the session's bucket after Kafka acknowledged what it recorded, and before it
answers its caller. Before serving a call of a held session, it reads the other workers' counters of that bucket:
unchanged since it last brought the session up to date means nobody else recorded for it, so the call costs two
memory reads instead of a round trip to the broker; changed means it catches the session up first. Each counter has
one writer (its worker), so no lock is taken per call; a 4-byte aligned store is atomic. Sessions that share a
bucket (crc32 of the id, 262,144 buckets) can only cause a needless rebuild, never a missed one.

A session's turns are numbered by one worker at a time: a worker records a turn holding a lock on the byte of the
session's bucket (`take` of `session_byte`, an open-file-description lock: `F_OFD_SETLK`, so two ledgers mapped by
one process exclude each other too), and, holding it, first catches the session up if another worker recorded for it
since. So two calls of one session served at once by two workers take turns k and k + 1, never k twice. Sessions
sharing a bucket share the lock (they only wait on each other). The lock dies with its worker: a SIGKILLed worker
holds nothing; one that hangs (stopped, or stuck) holds it on, so a wait for it has a limit, past which the waiter
gives up (`LockBusy`).

A call sent with an Idempotency-Key is run by one worker at a time the same way (`call_byte`): a lock on the byte of
its request id's bucket, in a second range of bytes past the buckets', held from before the worker checks whether
the call was recorded until it has recorded it (or failed), so a worker that takes it after another one finds the
call recorded and answers it as recorded instead of running it again. Request ids sharing a bucket wait on each
other needlessly, never run twice.

A worker takes a slot at start under an exclusive `flock` of the file: a free one, or that of a worker that died
(uvicorn starts a new worker in its place). The file lives as long as `serve` runs (`WorkerLedger.hosted`), which
holds a POSIX read lock on its first byte meanwhile: a `serve` that was SIGKILLed leaves its file behind unlocked,
and the next `serve` on the host removes it (2 MiB of memory per worker in /dev/shm otherwise, for every crash).
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forge_stream.proc import alive

BUCKETS = 1 << 18
_PID_BYTES = 8
_PREFIX = "forge-gateway-ledger-"
_STALE_AFTER_S = 10.0  # younger files are left alone: their `serve` may be about to lock them
# `serve` holds a read lock on byte 0 while it runs; byte 1 + b is the lock of bucket b, 1 + BUCKETS + c of calls' c
_SERVE_BYTE = 0
_LOCK_WAIT_S = (0.0005, 0.02)  # polling a lock another worker holds: first wait, longest wait


def _ofd_lock(fd: int, kind: int, offset: int) -> bool:
    """Take (F_WRLCK) or drop (F_UNLCK) the open-file-description lock of byte `offset` of `fd`, without waiting;
    False when another holds it. (struct flock: l_type, l_whence, l_start, l_len, l_pid, padded as the kernel's.)"""
    request = struct.pack("@hhqqi4x", kind, os.SEEK_SET, offset, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
    except (BlockingIOError, PermissionError):
        return False
    return True


def _size(workers: int) -> int:
    return workers * _PID_BYTES + BUCKETS * workers * 4


def _directory(directory: str | None) -> str:
    """Where ledger files go: `directory`, else /dev/shm where there is one (memory, not disk), else the temp dir."""
    return directory or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())


def remove_stale(directory: str) -> None:
    """Remove the ledger files in `directory` that no running `serve` holds (their `serve` was killed)."""
    for path in Path(directory).glob(_PREFIX + "*"):
        try:
            if time.time() - path.stat().st_mtime < _STALE_AFTER_S:
                continue
            fd = os.open(path, os.O_RDWR)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _SERVE_BYTE)
        except OSError:  # its `serve` runs
            continue
        else:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


class LockBusy(TimeoutError):
    """Another worker held a lock of the ledger past the wait's limit (it may be stuck or stopped)."""


class WorkerLedger:
    """One worker's view of the host's ledger file (`path`, made by `hosted` for `workers` processes)."""

    def __init__(self, path: str, workers: int):
        self.path, self.workers = path, workers
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _size(workers):
                raise ValueError(f"{path} is not a ledger for {workers} workers")
            self._map = mmap.mmap(fd, _size(workers))
            self.slot = self._claim(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # open while the worker runs: the bucket locks are taken on it
        self._held: dict[int, int] = {}  # locked byte -> how many of this worker's takers hold it
        self._pids = memoryview(self._map)[:workers * _PID_BYTES].cast("Q")
        self._counters = memoryview(self._map)[workers * _PID_BYTES:].cast("I")

    @staticmethod
    @contextmanager
    def hosted(workers: int, directory: str | None = None) -> Iterator[str]:
        """A new ledger file, locked (POSIX read lock) and removed when the block ends; first removes the files
        that `serve` processes which are gone left in the same directory."""
        directory = _directory(directory)
        remove_stale(directory)
        fd, path = WorkerLedger._new_file(workers, directory)
        try:
            yield path
        finally:
            os.unlink(path)
            os.close(fd)  # and with it the lock

    @staticmethod
    def _new_file(workers: int, directory: str) -> tuple[int, str]:
        fd, path = tempfile.mkstemp(prefix=_PREFIX, dir=directory)
        fcntl.lockf(fd, fcntl.LOCK_SH, 1, _SERVE_BYTE)
        os.ftruncate(fd, _size(workers))
        return fd, path

    def _claim(self, fd: int) -> int:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            pids = memoryview(self._map)[:self.workers * _PID_BYTES].cast("Q")
            try:
                for slot in range(self.workers):
                    if pids[slot] == 0 or not alive(pids[slot]):
                        pids[slot] = os.getpid()
                        return slot
            finally:
                pids.release()
            raise RuntimeError(f"all {self.workers} slots of the gateway's worker ledger {self.path} are held by "
                               "running workers: is another `gateway serve` using it?")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _bucket(self, session_id: str) -> int:
        return (zlib.crc32(session_id.encode()) % BUCKETS) * self.workers

    def others(self, session_id: str) -> tuple[int, ...]:
        """The other workers' counters of the session's bucket (compare them with those seen when the session was
        last brought up to date)."""
        base = self._bucket(session_id)
        row = self._counters[base:base + self.workers].tolist()
        del row[self.slot]
        return tuple(row)

    def wrote(self, session_id: str) -> None:
        """This worker recorded for the session (Kafka acknowledged it)."""
        i = self._bucket(session_id) + self.slot
        self._counters[i] = (self._counters[i] + 1) & 0xFFFFFFFF

    @staticmethod
    def session_byte(session_id: str) -> int:
        """The byte whose lock holds the session's turns: its bucket's."""
        return 1 + zlib.crc32(session_id.encode()) % BUCKETS

    @staticmethod
    def call_byte(request_id: str) -> int:
        """The byte whose lock `claim`s the call `request_id`: past the buckets' locks."""
        return 1 + BUCKETS + zlib.crc32(request_id.encode()) % BUCKETS

    async def take(self, byte: int, wait_s: float) -> None:
        """Take the lock of `byte` against the other workers (this worker's takers share it: each `drop`s it once),
        polling while another worker holds it; LockBusy when it still does after `wait_s` seconds."""
        if byte not in self._held:
            wait, deadline = _LOCK_WAIT_S[0], time.monotonic() + wait_s
            while not _ofd_lock(self._fd, fcntl.F_WRLCK, byte):
                if byte in self._held:  # another of this worker's takers took it meanwhile: share it
                    break
                if time.monotonic() >= deadline:
                    raise LockBusy(f"another worker has held lock {byte} of {self.path} for over {wait_s:g} s")
                await asyncio.sleep(wait)
                wait = min(wait * 2, _LOCK_WAIT_S[1])
        self._held[byte] = self._held.get(byte, 0) + 1

    def drop(self, byte: int) -> None:
        """Let go of a `take` of `byte`; the lock is released when this worker's last taker lets go."""
        self._held[byte] -= 1
        if not self._held[byte]:
            del self._held[byte]
            _ofd_lock(self._fd, fcntl.F_UNLCK, byte)

    def close(self) -> None:
        if self._map.closed:
            return
        os.close(self._fd)
        self._pids[self.slot] = 0
        self._pids.release()
        self._counters.release()
        self._map.close()
