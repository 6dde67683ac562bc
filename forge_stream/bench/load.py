"""Load benchmark of the gateway: many concurrent agents for a fixed time, then a check against Kafka that every
acknowledged answer was recorded, once.

A scripted engine (its own process, `delay_ms` per completion) and the gateway (`forge-stream gateway serve
--workers N`, with a bounded number of calls in flight and waiting) run on the bench's own broker unless one is
given. Each agent is an asyncio task on one shared httpx client: it opens a session, asks a chat completion with a
calculator tool (the engine answers a tool call), sends the tool result (the engine answers text), finishes the
session, and starts over until the time is up. Every `parallel_every`-th agent asks its first turn as a burst of 2,
3 or 4 chat calls at once in the one session (as an agent that fans out sub-queries does); the connections of a
burst land on different workers as the kernel spreads them. Every chat call carries a unique id at the end of its
last message; a 200 answer puts it in `acknowledged`, a 429/503 in `shed` (the agent waits the answer's
retry-after-ms, then retries with a new id).

After the run the completions topic is read back (from the offsets before the run): `lost` counts
acknowledged ids missing from it, `duplicates` ids recorded more than once, `shed_recorded` shed ids recorded
anyway, `duplicate_turns` the turns (session id, turn, choice index) that more than one request recorded, so two
calls of a session got the same turn (all four must be 0). `orphans` counts the processes the bench started (the
broker, the engine, the gateway and its workers, and whatever they started: every descendant of the bench's process
that was not there before it) still running after it stopped them (must be 0; `orphan_processes` names them).
`p50_ms`/`p99_ms` are the latencies of successful chat calls; `rss_mb_max` the gateway's peak resident memory (all
its processes), sampled from /proc/<pid>/status while the agents run.

`hosts` > 1 runs that many gateways (each `serve --workers N` with its own ledger and home, as on separate hosts)
behind HAProxy with the shipped config (`forge-stream gateway balance`: each session to one host by its id; the
agents name the session they open with X-Forge-Session), and `kill_host_after_s` SIGKILLs the last host (its
supervisor and workers) that long into the run: its sessions move to the others, which rebuild them from Kafka. A
call its host died under (HAProxy's 502/503/504, or a reset) is counted in `unanswered` and sent again with a new id;
`lost` and `duplicate_turns` still count what was acknowledged and what was recorded. A finish sent again that gets
409 (the session is finished: the first try finished it and its answer was lost) is done, as the rollout client
takes it, and counted in `finished_before`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import ExitStack
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from forge_stream.bench import bench_kafka
from forge_stream.kafka.admin import end_offsets
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.proc import running
from forge_stream.topics import TOPICS

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
_BALANCED: ContextVar[bool] = ContextVar("balanced", default=False)  # the agents call through HAProxy


@dataclass(frozen=True)
class LoadSettings:
    agents: int = 200
    seconds: float = 60.0
    max_in_flight: int = 64  # the gateway's admission bounds
    max_waiting: int = 64
    retry_after_s: float = 0.5  # the gateway's Retry-After on a shed call
    engine_delay_ms: float = 50.0  # time the scripted engine takes per completion
    client_timeout_s: float = 30.0
    workers: int = 2  # gateway processes serving the port
    parallel_every: int = 4  # every n-th agent asks its first turn as a burst of parallel calls (0: none)
    hosts: int = 1  # gateways, behind HAProxy when more than one
    kill_host_after_s: float | None = None  # SIGKILL the last host this long into the run (hosts > 1)
    bootstrap: str | None = None


@dataclass
class Tally:
    acknowledged: set[str] = field(default_factory=set)
    shed_ids: set[str] = field(default_factory=set)
    shed: Counter = field(default_factory=Counter)  # status -> count
    shed_without_retry_after: int = 0
    errors: Counter = field(default_factory=Counter)  # other non-2xx status (or exception name) -> count
    unanswered: int = 0  # calls the balancer found no answer for (their host died under them), sent again
    finished_before: int = 0  # finishes sent again whose first try had finished the session (its answer lost): 409
    latencies_ms: list[float] = field(default_factory=list)
    sessions: int = 0
    burst_sessions: int = 0  # sessions that asked a turn as a burst of parallel calls


def _retry_delay(response: httpx.Response) -> float | None:
    ms = response.headers.get("retry-after-ms")
    if ms is not None:
        return float(ms) / 1000
    seconds = response.headers.get("retry-after")
    return float(seconds) if seconds is not None else None


async def _post(client: httpx.AsyncClient, path: str, make_body, tally: Tally, deadline: float,
                chat: bool = False, headers: dict | None = None, done_status: int | None = None
                ) -> httpx.Response | None:
    """POST until answered other than 429/503 (waiting each shed answer's delay); None past the deadline or on
    any other failure. `make_body(call_id)` builds each attempt's body. Behind a balancer, a call its host died
    under is sent again; then `done_status` (a finish's 409) says that the try whose answer was lost did it."""
    lost_answer = False
    while time.monotonic() < deadline:
        call_id = uuid.uuid4().hex
        start = time.perf_counter()
        try:
            response = await client.post(path, content=orjson.dumps(make_body(call_id)),
                                         headers={"content-type": "application/json", **(headers or {})})
        except httpx.TransportError as exc:
            if not _BALANCED.get():
                tally.errors[type(exc).__name__] += 1
                return None
            response = None
        if response is None or _BALANCED.get() and response.status_code in (502, 504) or \
                _BALANCED.get() and response.status_code == 503 and "retry-after" not in response.headers:
            tally.unanswered += 1
            lost_answer = True
            await asyncio.sleep(0.1)
            continue
        if response.status_code in (429, 503):
            tally.shed[response.status_code] += 1
            if chat:
                tally.shed_ids.add(call_id)
            delay = _retry_delay(response)
            if delay is None:
                tally.shed_without_retry_after += 1
            await asyncio.sleep(delay or 1.0)
            continue
        if lost_answer and response.status_code == done_status:
            tally.finished_before += 1
            return response
        if response.status_code >= 300:
            tally.errors[response.status_code] += 1
            return None
        if chat:
            tally.acknowledged.add(call_id)
            tally.latencies_ms.append((time.perf_counter() - start) * 1000)
        return response
    return None


def _tagged(text: str, call_id: str) -> str:
    return f"{text} #{call_id}"


def burst_size(index: int, every: int) -> int:
    """How many chat calls agent `index` sends at once for its first turn: 2, 3, 4, 2, ... for every `every`-th
    agent, 1 for the others.

    >>> [burst_size(i, 2) for i in range(8)], burst_size(0, 0)
    ([2, 1, 3, 1, 4, 1, 2, 1], 1)
    """
    return 2 + (index // every) % 3 if every and index % every == 0 else 1


async def _agent(client: httpx.AsyncClient, run: str, index: int, deadline: float, tally: Tally,
                 burst: int) -> None:
    episode = 0
    while time.monotonic() < deadline:
        session_id = f"{run}-{index}-{episode}"
        episode += 1
        opened = await _post(client, "/v1/sessions", lambda _: {
            "session_id": session_id, "group_id": f"{run}-{index}", "task_id": "load"}, tally, deadline,
            headers={"X-Forge-Session": session_id})  # behind a balancer: opened on the host that serves it
        if opened is None:
            return
        chat = f"/s/{session_id}/v1/chat/completions"
        messages = [{"role": "system", "content": "You are a load-test agent."}]
        answers = await asyncio.gather(*(_post(client, chat, lambda call_id: {
            "model": "scripted", "max_tokens": 256, "tools": TOOLS,
            "messages": messages + [{"role": "user", "content": _tagged("What is 6*7?", call_id)}]},
            tally, deadline, chat=True) for _ in range(burst)))
        if None in answers:
            return
        first = answers[0]
        tally.burst_sessions += burst > 1
        sent = orjson.loads(first.request.content)["messages"]
        message = first.json()["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        history = sent + [message]
        second = await _post(client, chat, lambda call_id: {
            "model": "scripted", "max_tokens": 256, "tools": TOOLS,
            "messages": history + [{"role": "tool", "tool_call_id": calls[0]["id"] if calls else "none",
                                    "content": _tagged("42", call_id)}]}, tally, deadline, chat=True)
        if second is None:
            return
        if await _post(client, f"/v1/sessions/{session_id}/finish", lambda _: {"status": "ok"},
                       tally, deadline, done_status=409) is None:
            return
        tally.sessions += 1


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process running now (zombies aside), from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name, in parentheses, may hold spaces
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return out


def descendants(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of every process below `root`: its children, theirs, and so on. The start time tells a
    process from a later one that got its pid."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.add((pid, procs[pid][1]))
        todo.extend(children.get(pid, ()))
    return found


def still_running(started: set[tuple[int, int]]) -> list[str]:
    """The command lines of the processes in `started` that still run."""
    procs = _processes()
    out = []
    for pid, start in sorted(started):
        if procs.get(pid, (0, None))[1] == start:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                # empty for a moment inside exec (and for a zombie): its name then, so the entry still says something
                out.append(command or f"[{Path(f'/proc/{pid}/comm').read_text().strip()}]")
            except OSError:  # it ended meanwhile
                continue
    return out


def _rss_mb(pids: list[int]) -> float:
    """Resident memory of `pids` and their descendants (each gateway's supervisor and workers), in MiB."""
    total = 0
    for proc in [*pids, *(p for pid in pids for p, _ in descendants(pid))]:
        try:
            status = Path(f"/proc/{proc}/status").read_text()
        except OSError:  # a worker that ended meanwhile
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    if not total:
        raise RuntimeError(f"no VmRSS for processes {pids}")
    return total / 1024


async def _drive(settings: LoadSettings, gateway_url: str, gateways: list[tuple[str, subprocess.Popen]], run: str,
                 tally: Tally) -> dict:
    """Run the agents against `gateway_url` (a gateway, or the balancer in front of `gateways`: URL and process
    each), killing the last gateway `kill_host_after_s` into the run."""
    limits = httpx.Limits(max_connections=settings.agents + 8, max_keepalive_connections=settings.agents + 8)
    samples: list[float] = []
    stop = asyncio.Event()
    live = list(gateways)

    async def kill_host() -> None:
        await asyncio.sleep(settings.kill_host_after_s)
        _, proc = live.pop()
        os.killpg(proc.pid, signal.SIGKILL)  # the host's supervisor and its workers

    async def sample() -> None:
        while not stop.is_set():
            samples.append(_rss_mb([proc.pid for _, proc in live]))
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except TimeoutError:
                pass

    async with httpx.AsyncClient(base_url=gateway_url, limits=limits,
                                 timeout=settings.client_timeout_s) as client:
        sampler = asyncio.create_task(sample())
        start = time.monotonic()
        deadline = start + settings.seconds
        _BALANCED.set(len(gateways) > 1)
        killer = asyncio.create_task(kill_host()) if settings.kill_host_after_s is not None else None
        await asyncio.gather(*(_agent(client, run, i, deadline, tally, burst_size(i, settings.parallel_every))
                               for i in range(settings.agents)))
        elapsed = time.monotonic() - start
        if killer is not None:
            killer.cancel()
        stop.set()
        await sampler
        healths = [(await client.get(f"{url}/health")).json() for url, _ in live]
    health = {key: sum(h[key] for h in healths) for key in ("sessions", "open_sessions")}
    return {"elapsed_s": elapsed, "rss_mb_start": samples[0], "rss_mb_max": max(samples),
            "rss_mb_end": samples[-1], "health": health}


@dataclass
class ReadBack:
    """What forge.completions holds of the run."""

    seen: Counter = field(default_factory=Counter)  # call id -> times recorded
    requests: dict[tuple[str, int, int], set[str]] = field(default_factory=dict)  # turn -> request ids recording it

    @property
    def duplicate_turns(self) -> int:
        """Turns (session id, turn, choice index) recorded by more than one request."""
        return sum(len(ids) > 1 for ids in self.requests.values())


def _read_back(bootstrap: str, before: dict[int, int], run: str) -> ReadBack:
    """The run's Completions in forge.completions since `before`: each call id's count, each turn's requests."""
    out = ReadBack()
    for event in read_slice(bootstrap, TOPICS.completions, Slice(start_offsets=before)):
        record = event.record
        if record["session_id"].startswith(run + "-"):
            last = orjson.loads(record["messages_json"])[-1]
            out.seen[str(last.get("content") or "").rsplit("#", 1)[-1]] += 1
            turn = (record["session_id"], record["turn"], record["choice_index"])
            out.requests.setdefault(turn, set()).add(record["request_id"])
    return out


def _percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)] if ordered else None


def _gateway(stack: ExitStack, settings: LoadSettings, home: Path, kafka: str,
             engine_port: int) -> tuple[str, subprocess.Popen]:
    """A gateway host: `serve --workers N` with a home of its own (its own ledger), in a process group of its own."""
    port = free_port()
    home.mkdir()
    proc = stack.enter_context(running(
        [sys.executable, "-c", "from forge_stream.cli import main; main()", "gateway", "serve", "--engine",
         f"http://127.0.0.1:{engine_port}", "--port", str(port), "--bootstrap-servers", kafka,
         "--max-in-flight", str(settings.max_in_flight), "--max-waiting", str(settings.max_waiting),
         "--shed-retry-after-s", str(settings.retry_after_s), "--workers", str(settings.workers)],
        url=f"http://127.0.0.1:{port}/health", log=home / "gateway.log", stop_timeout=10, new_session=True,
        env={**os.environ, "FORGE_HOME": str(home)}))
    return f"http://127.0.0.1:{port}", proc


def _balancer(stack: ExitStack, gateways: list[tuple[str, subprocess.Popen]], work: Path) -> str:
    """HAProxy with the shipped config in front of `gateways`; its URL."""
    port = free_port()
    backends = [a for url, _ in gateways for a in ("--backend", url.removeprefix("http://"))]
    stack.enter_context(running(
        [sys.executable, "-m", "forge_stream", "gateway", "balance", *backends, "--port", str(port), "--check-ms",
         "500", "--config", str(work / "haproxy.cfg")],
        url=f"http://127.0.0.1:{port}/health", log=work / "haproxy.log", stop_timeout=10))
    return f"http://127.0.0.1:{port}"


def run(settings: LoadSettings = LoadSettings()) -> dict:
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    run_id = "load-" + uuid.uuid4().hex[:8]
    tally = Tally()
    before_run = descendants(os.getpid())  # not the bench's: a broker of the caller's, say
    started: set[tuple[int, int]] = set()
    with tempfile.TemporaryDirectory(prefix="forge-bench-load-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        kafka = stack.enter_context(bench_kafka(settings.bootstrap, work))
        engine_port = free_port()
        stack.enter_context(running(
            [sys.executable, "-m", "forge_stream.bench.scripted", "--port", str(engine_port),
             "--reply", "The answer is 42.", "--tool-call", CALL, "--delay-ms", str(settings.engine_delay_ms)],
            url=f"http://127.0.0.1:{engine_port}/health", log=work / "engine.log", stop_timeout=10))
        gateways = [_gateway(stack, settings, work / f"gateway-{i}", kafka, engine_port)
                    for i in range(settings.hosts)]
        gateway_url = gateways[0][0] if settings.hosts == 1 else _balancer(stack, gateways, work)
        before = end_offsets(kafka, TOPICS.completions.name, TOPICS.completions.partitions)
        started |= descendants(os.getpid()) - before_run
        loop = loop_factory()
        try:
            driven = loop.run_until_complete(_drive(settings, gateway_url, gateways, run_id, tally))
        finally:
            loop.close()
        recorded = _read_back(kafka, before, run_id)
        started |= descendants(os.getpid()) - before_run  # a worker restarted during the run, say
    orphans = still_running(started)
    seen = recorded.seen
    health = driven.pop("health")
    return {
        "agents": settings.agents, "seconds": settings.seconds, "elapsed_s": driven["elapsed_s"],
        "acknowledged": len(tally.acknowledged),
        "lost": len(tally.acknowledged - seen.keys()),
        "duplicates": sum(count - 1 for count in seen.values()),
        "shed_recorded": len(tally.shed_ids & seen.keys()),
        "duplicate_turns": recorded.duplicate_turns, "turns_recorded": len(recorded.requests),
        "orphans": len(orphans), "orphan_processes": orphans, "processes_started": len(started),
        "shed": sum(tally.shed.values()), "shed_429": tally.shed[429], "shed_503": tally.shed[503],
        "shed_without_retry_after": tally.shed_without_retry_after,
        "errors": {str(k): v for k, v in tally.errors.items()},
        "acknowledged_per_s": len(tally.acknowledged) / driven["elapsed_s"],
        "sessions_finished": tally.sessions, "burst_sessions": tally.burst_sessions,
        "p50_ms": _percentile(tally.latencies_ms, 0.50), "p99_ms": _percentile(tally.latencies_ms, 0.99),
        "rss_mb_start": driven["rss_mb_start"], "rss_mb_max": driven["rss_mb_max"],
        "rss_mb_end": driven["rss_mb_end"],
        "gateway_sessions_kept": health["sessions"], "gateway_open_sessions": health["open_sessions"],
        "max_in_flight": settings.max_in_flight, "max_waiting": settings.max_waiting,
        "engine_delay_ms": settings.engine_delay_ms, "workers": settings.workers,
        "parallel_every": settings.parallel_every, "hosts": settings.hosts,
        "hosts_killed": int(settings.kill_host_after_s is not None), "unanswered": tally.unanswered,
        "finished_before": tally.finished_before,
    }
