"""A pool of long-lived agent processes that run many episodes each (starting Python per episode costs ~1 s of CPU).

`PooledCommandAgent(command, workers, per_worker)` starts `workers` processes of `command` and speaks JSON lines
with them. Per episode it writes one line on a worker's stdin:

    {"id": "...", "base_url": "http://gateway/s/<session>/v1", "api_key": "...", "task": {...}}

and the worker answers, in any order, one line on its stdout:

    {"id": "...", "output": "..."}   or   {"id": "...", "error": "..."}

A worker has at most `per_worker` episodes in flight (it gets FORGE_AGENT_THREADS=per_worker in its environment to
size its own pool); an episode goes to the least busy worker. Workers run in their own process sessions, so a
signal meant for the controller's process group (Ctrl-C, `forge-stream down`) does not cut their episodes short;
they exit when their stdin closes. A worker that exits fails only its in-flight
episodes (with the tail of its stderr) and is started again for the next episode. Lines on stdout that are not
JSON objects with a known id are ignored (logged), so a stray print does not break the pool.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shlex
import uuid
from dataclasses import dataclass, field

from forge_stream.credentials import agent_env
from forge_stream.rollout.agents import AgentContext, AgentResult

log = logging.getLogger(__name__)
LINE_LIMIT = 16 * 1024 * 1024


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    waiting: dict[str, asyncio.Future] = field(default_factory=dict)
    stderr: collections.deque = field(default_factory=lambda: collections.deque(maxlen=5))
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


class PooledCommandAgent:
    """An `Agent` that runs episodes on a pool of `command` processes speaking the JSON-lines protocol."""

    def __init__(self, command: str, workers: int = 2, per_worker: int = 16, timeout_s: float = 600.0):
        if workers < 1 or per_worker < 1:
            raise ValueError("a pool needs at least one worker and one episode per worker")
        self.command = command
        self.per_worker = per_worker
        self.timeout_s = timeout_s
        self._workers: list[_Worker | None] = [None] * workers
        self._free = asyncio.Semaphore(workers * per_worker)
        self._lock = asyncio.Lock()

    async def _start(self) -> _Worker:
        env = {**agent_env(os.environ), "FORGE_AGENT_THREADS": str(self.per_worker)}
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(self.command), env=env, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=LINE_LIMIT, start_new_session=True)
        worker = _Worker(proc)
        worker.tasks = [asyncio.create_task(self._read(worker)), asyncio.create_task(self._drain(worker))]
        return worker

    async def _read(self, worker: _Worker) -> None:
        while line := await worker.proc.stdout.readline():
            try:
                reply = json.loads(line)
                future = worker.waiting.pop(reply["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("agent worker %s printed a line that is no answer: %.200r", worker.proc.pid, line)
                continue
            if not future.done():
                future.set_result(reply)
        code = await worker.proc.wait()
        await asyncio.sleep(0.05)  # let the stderr reader catch the last lines
        reason = f"agent worker exited with {code}: {' | '.join(worker.stderr)}"
        for future in worker.waiting.values():
            if not future.done():
                future.set_result({"error": reason})
        worker.waiting.clear()

    async def _drain(self, worker: _Worker) -> None:
        while line := await worker.proc.stderr.readline():
            worker.stderr.append(line.decode(errors="replace").rstrip())

    async def _pick(self) -> _Worker:
        """The least busy live worker, (re)starting dead or missing ones."""
        async with self._lock:
            for i, worker in enumerate(self._workers):
                if worker is None or not worker.alive:
                    self._workers[i] = await self._start()
            return min(self._workers, key=lambda w: len(w.waiting))

    async def __call__(self, ctx: AgentContext) -> AgentResult:
        async with self._free:
            worker = await self._pick()
            episode = uuid.uuid4().hex
            future = asyncio.get_running_loop().create_future()
            worker.waiting[episode] = future
            line = json.dumps({"id": episode, "base_url": ctx.base_url, "api_key": ctx.api_key,
                               "task": ctx.task}) + "\n"
            try:
                worker.proc.stdin.write(line.encode())
                await worker.proc.stdin.drain()
                reply = await asyncio.wait_for(future, self.timeout_s)
            except (BrokenPipeError, ConnectionResetError):
                reply = await future  # the reader fails it with the worker's exit reason
            except asyncio.TimeoutError:
                reply = {"error": f"agent timed out after {self.timeout_s:.0f}s"}
            finally:
                worker.waiting.pop(episode, None)
        if "error" in reply:
            return AgentResult("", False, str(reply["error"]))
        return AgentResult(str(reply.get("output", "")), True)

    async def aclose(self) -> None:
        """Close the workers' stdin (they exit when it ends), then stop any that do not."""
        for worker in filter(None, self._workers):
            if worker.alive:
                worker.proc.stdin.close()
        for worker in filter(None, self._workers):
            try:
                await asyncio.wait_for(worker.proc.wait(), 5)
            except asyncio.TimeoutError:
                worker.proc.kill()
                await worker.proc.wait()
            await asyncio.gather(*worker.tasks)
