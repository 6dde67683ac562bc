"""Benchmark of the gateway's own cost: latency through the gateway vs straight to the engine, and recorded
completions per second with Kafka acknowledgement.

Both sides hit the same scripted engine (a separate process that answers at once in vLLM's format, token ids and
logprobs included), so the difference is what the gateway adds: parsing, forwarding, building and Avro-encoding
the Completion event, and waiting for Kafka's acks=all acknowledgement before answering. The gateway runs as its
own process (`forge-stream gateway serve`); the load comes from a minimal keep-alive HTTP/1.1 client (one
connection per concurrent caller, kept for the whole run) so the client's cost stays small. Phases alternate direct
and gateway runs at each concurrency, in several rounds at the highest, whose median round (by ratio) is reported:
the machine's other jobs slow one phase or another. `recorded_per_s` is the gateway throughput at the highest
concurrency; every gateway answer means an acknowledged Completion event, and the completions topic's end offsets are checked to have grown by
exactly the number of gateway answers. With `floor`, a pass-through proxy on the same servers and client
(forge_stream.bench.passthrough) is measured too, recording nothing and then writing each answer to a scratch topic
before answering: what the gateway costs beyond those is its own work (sessions, events, prompt references).
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson

from forge_stream.bench.scripted import encode, render
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.bench import bench_kafka
from forge_stream.kafka.admin import end_offsets, scratch_topic
from forge_stream.kafka.broker import free_port
from forge_stream.proc import running
from forge_stream.topics import TOPICS


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _caller(connection: Connection, request: bytes, count: int, latencies: list[int],
                  errors: list[int]) -> None:
    reader, writer = connection
    for _ in range(count):
        start = time.perf_counter_ns()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await reader.readexactly(length)
        latencies.append(time.perf_counter_ns() - start)
        if head[9:12] != b"200":
            errors.append(int(head[9:12]))


class _Callers:
    """The load client's keep-alive connections to one server, caller i's always the i-th (so a session's calls
    keep to one gateway worker, as an agent's pooled connection does), or new ones for every phase with
    `reconnect` (then about half the sessions move to another worker at each phase, and are caught up there)."""

    def __init__(self, port: int, reconnect: bool = False):
        self.port, self.reconnect = port, reconnect
        self.open: list[Connection] = []

    async def take(self, n: int) -> list[Connection]:
        if self.reconnect:
            self.close()
        for i, (reader, writer) in enumerate(self.open[:n]):
            if reader.at_eof() or writer.is_closing():  # idle past the server's keep-alive: closed there
                writer.close()
                self.open[i] = await asyncio.open_connection("127.0.0.1", self.port)
        while len(self.open) < n:
            self.open.append(await asyncio.open_connection("127.0.0.1", self.port))
        return self.open[:n]

    def close(self) -> None:
        for _, writer in self.open:
            writer.close()
        self.open = []


async def _phase(callers: _Callers, requests: list[bytes], total: int) -> dict:
    latencies: list[int] = []
    errors: list[int] = []
    per = max(total // len(requests), 1)
    connections = await callers.take(len(requests))
    start = time.perf_counter()
    await asyncio.gather(*(_caller(c, r, per, latencies, errors) for c, r in zip(connections, requests)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    pick = lambda q: latencies[min(int(q * len(latencies)), len(latencies) - 1)] / 1e6  # noqa: E731
    return {"requests": len(latencies), "errors": len(errors), "per_s": len(latencies) / elapsed,
            "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


def _ratio(direct: dict, through: dict) -> float:
    """The gateway's rate over the direct engine's, of one round (0 when a gateway call failed)."""
    return round(through["per_s"] / direct["per_s"], 3) if through["errors"] == 0 else 0.0


def _cpu_seconds(pid: int, descendants: bool = True) -> float:
    """CPU seconds of a process and all its descendants (a gateway's --workers are its children), or of the process
    alone. This process alone is read from its own clock: /proc counts 10 ms ticks, more than a short run's client
    spends."""
    if pid == os.getpid() and not descendants:
        return time.process_time()
    total = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if descendants:
            todo += [int(child) for child in children]
    return total


async def _measured(phase, pids: dict[str, int]) -> dict:
    """The phase's result with the CPU milliseconds each process (`pids`: name -> pid; children included but for the
    client, this process, whose children are the others) spent per answered request while it ran, and the whole
    machine's (every process, from /proc/stat: other jobs on the machine show there)."""
    before = {name: _cpu_seconds(pid, name != "client") for name, pid in pids.items()}
    machine = _machine_cpu_seconds()
    result = await phase
    count = max(result["requests"], 1)
    spent = {name: (_cpu_seconds(pid, name != "client") - before[name]) * 1000 / count for name, pid in pids.items()}
    spent["machine"] = (_machine_cpu_seconds() - machine) * 1000 / count
    result["cpu_ms_per_request"] = {name: round(ms, 3) for name, ms in spent.items()}
    return result


def _machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far (every core: user, nice, system, irq, softirq, steal)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def run(requests: int = 20000, prompt_bytes: int = 1000, concurrency: tuple[int, ...] = (1, 64),
        bootstrap: str | None = None, workers: int = 1, linger_ms: float = GatewaySettings.linger_ms,
        shared_sessions: bool = False, floor: bool = False, rounds: int = 3, reconnect: bool = False) -> dict:
    """Measure; `requests` per phase at the highest concurrency (a quarter of it at concurrency 1). `workers` > 1
    runs the gateway as that many processes on its port (`gateway serve --workers`: replicas sharing sessions).
    `floor` also measures, at the highest concurrency, a pass-through proxy with as many workers
    (forge_stream.bench.passthrough): the same servers and client with nothing recorded, then with the engine's
    answer written to a scratch topic and acknowledged before answering (`floor` in the result). The top
    concurrency runs `rounds` direct/gateway pairs, one after the other: the ratio reported is the median round's, so
    one phase slowed by another job on the machine does not make the figure. Each caller keeps one connection for
    the whole run (its session stays on one worker), or opens a new one for every phase with `reconnect`."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = asyncio.new_event_loop
    with tempfile.TemporaryDirectory(prefix="forge-bench-gw-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        kafka = stack.enter_context(bench_kafka(bootstrap, work))
        engine_port, gateway_port = free_port(), free_port()
        engine = stack.enter_context(running([sys.executable, "-m", "forge_stream.bench.scripted", "--port",
                                              str(engine_port),
                                     "--reply", "The answer is 42, computed by the scripted engine."],
                                    url=f"http://127.0.0.1:{engine_port}/health", log=work / "engine.log",
                                    stop_timeout=10))
        gateway = stack.enter_context(running(
            [sys.executable, "-c", "from forge_stream.cli import main; main()", "gateway", "serve", "--engine",
             f"http://127.0.0.1:{engine_port}", "--port", str(gateway_port), "--bootstrap-servers", kafka,
             "--linger-ms", str(linger_ms), *(["--workers", str(workers)] if workers > 1 else []),
             *(["--shared-sessions"] if shared_sessions else [])],
            url=f"http://127.0.0.1:{gateway_port}/health", log=work / "gateway.log", stop_timeout=10))
        gateway_url = f"http://127.0.0.1:{gateway_port}"
        callers = max(concurrency)
        if floor:
            topic = stack.enter_context(scratch_topic(kafka, f"forge-bench.pass-through-{os.getpid()}",
                                                      TOPICS.completions.partitions))
            floor_port = free_port()
            passthrough = stack.enter_context(running(
                [sys.executable, "-m", "forge_stream.bench.passthrough", "--port", str(floor_port), "--engine",
                 f"http://127.0.0.1:{engine_port}", "--bootstrap", kafka, "--topic", topic, "--linger-ms",
                 str(linger_ms), "--workers", str(workers)],
                url=f"http://127.0.0.1:{floor_port}/health", log=work / "passthrough.log", stop_timeout=10))
        sessions = [httpx.post(f"{gateway_url}/v1/sessions", json={"group_id": f"bench-{i % 8}",
                                                                   "task_id": "bench"}).json()["session_id"]
                    for i in range(callers)]
        messages = [{"role": "system", "content": "You are a benchmark agent."},
                    {"role": "user", "content": "x" * prompt_bytes}]
        body = {"model": "scripted", "messages": messages, "max_tokens": 64}
        direct_req = _request("/v1/chat/completions", orjson.dumps({**body, "return_token_ids": True,
                                                                    "logprobs": True}))
        gateway_reqs = [_request(f"/s/{s}/v1/chat/completions", orjson.dumps(body)) for s in sessions]
        pids = {"gateway": gateway.pid, "engine": engine.pid, "client": os.getpid()}
        broker_pid = work / "kafka" / "broker.pid"  # the bench's own broker (none when given one)
        if broker_pid.exists():
            pids["broker"] = int(broker_pid.read_text())
        before = sum(end_offsets(kafka, TOPICS.completions.name, TOPICS.completions.partitions).values())

        async def measure() -> dict:
            to_gateway, to_engine = _Callers(gateway_port, reconnect), _Callers(engine_port, reconnect)
            try:
                warm = await _phase(to_gateway, gateway_reqs, 500)  # warm-up (connections, caches, producer)
                await _phase(to_engine, [direct_req] * callers, 500)
                out = {"warm-up": warm}
                for c in concurrency:
                    total = requests if c == max(concurrency) else max(requests // 4, 100)
                    out[c] = []
                    for _ in range(rounds if c == max(concurrency) else 1):
                        direct = await _measured(_phase(to_engine, [direct_req] * c, total), pids)
                        through = await _measured(_phase(to_gateway, gateway_reqs[:c], total), pids)
                        through["gateway_cpu_ms_per_request"] = through["cpu_ms_per_request"]["gateway"]
                        out[c].append((direct, through))
            finally:
                to_gateway.close()
                to_engine.close()
            if floor:
                floor_pids = {**pids, "pass_through": passthrough.pid}
                del floor_pids["gateway"]
                to_floor = _Callers(floor_port, reconnect)
                try:
                    for name, path in (("pass_through", "/v1/chat/completions"),
                                       ("pass_through_acked", "/acked/v1/chat/completions")):
                        request = _request(path, orjson.dumps(body))
                        warmed = await _phase(to_floor, [request] * callers, 500)
                        out[name] = await _measured(_phase(to_floor, [request] * callers, requests), floor_pids)
                        out[name]["answered_with_warm_up"] = warmed["requests"] + out[name]["requests"]
                finally:
                    to_floor.close()
            return out

        loop = loop_factory()
        try:
            phases = loop.run_until_complete(measure())
        finally:
            loop.close()
        after = sum(end_offsets(kafka, TOPICS.completions.name, TOPICS.completions.partitions).values())
        if floor:  # every acknowledged answer of the pass-through wrote one record, and only those did
            acked = phases["pass_through_acked"]
            acked["records_checked"] = (sum(end_offsets(kafka, topic, TOPICS.completions.partitions).values())
                                        == acked.pop("answered_with_warm_up"))
            phases["pass_through"].pop("answered_with_warm_up")

    warm = phases.pop("warm-up")
    floors = {name: phases.pop(name) for name in ("pass_through", "pass_through_acked") if name in phases}
    answered = warm["requests"] - warm["errors"] + sum(t["requests"] - t["errors"]
                                                      for pairs in phases.values() for _, t in pairs)
    pairs_at_top = phases[max(concurrency)]
    ratios = [_ratio(direct, through) for direct, through in pairs_at_top]
    median = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    phases = {c: pairs[median] if c == max(concurrency) else pairs[0] for c, pairs in phases.items()}
    top_direct, top_gateway = phases[max(concurrency)]
    result = {
        "p50_overhead_ms": top_gateway["p50_ms"] - top_direct["p50_ms"],
        "p99_overhead_ms": top_gateway["p99_ms"] - top_direct["p99_ms"],
        "recorded_per_s": top_gateway["per_s"] if top_gateway["errors"] == 0 else 0.0,
        "engine_per_s": top_direct["per_s"],
        "gateway_to_engine": ratios[median],
        # each round at the top concurrency: its direct phase, then its gateway phase; the figures above and under
        # "concurrency" are the median round's (by ratio)
        "rounds": [{"engine_per_s": round(direct["per_s"]), "recorded_per_s": round(through["per_s"]),
                    "gateway_to_engine": ratio, "gateway_cpu_ms_per_request": through["gateway_cpu_ms_per_request"],
                    "machine_cpu_ms_per_request": through["cpu_ms_per_request"]["machine"]}
                   for (direct, through), ratio in zip(pairs_at_top, ratios)],
        "gateway_cpu_ms_per_request": top_gateway["gateway_cpu_ms_per_request"],
        # where the machine's CPU goes per request at the top concurrency, through the gateway and direct
        "cpu_ms_per_request": {"through_gateway": top_gateway["cpu_ms_per_request"],
                               "direct": top_direct["cpu_ms_per_request"]},
        "workers": workers,
        "reconnect": reconnect,
        "linger_ms": linger_ms,
        "sessions_shared_by": "kafka" if shared_sessions else "ledger" if workers > 1 else None,
        "recorded_events_checked": after - before == answered,
        "cores": os.cpu_count(),
        "prompt_tokens": len(encode(render(messages, None))),
        "concurrency": {},
    }
    for c, (direct, through) in phases.items():
        result["concurrency"][str(c)] = {
            "direct": direct, "gateway": through,
            "p50_overhead_ms": through["p50_ms"] - direct["p50_ms"],
            "p99_overhead_ms": through["p99_ms"] - direct["p99_ms"]}
    if floors:  # what the same servers and client reach recording nothing, then writing the answer to Kafka
        result["floor"] = {name: {**phase, "to_engine": round(phase["per_s"] / top_direct["per_s"], 3)}
                           for name, phase in floors.items()}
    return result
