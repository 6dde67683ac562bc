"""Benchmark of long horizons through the whole data plane: one group of G sessions, each to 200K+ tokens of
context over 200+ turns with context-management resets, through the gateway, Kafka, the processors and one
training step on the tiny model.

Real parts: a Kafka broker of its own, the gateway and the processors (faust worker) as processes, the trainer's
step in this process. The engine is the scripted one (byte-level tokens, instant answers), so what is measured is
the pipeline's cost, not decoding. The agent is scripted too, a plain HTTP client: each turn it appends a message
of `append_tokens` bytes (a tool result after a tool call, else a user message) and sends the whole history, as
an agent does. At each turn listed in `resets` it manages its context: it asks the model, through the same base
URL, to summarize, and goes on from [system, task + summary] (a prompt the gateway records whole: a new branch
of the session's tree). Before every gateway call the same request goes straight to the engine, so each turn
gives the gateway's overhead (through the gateway minus direct) at that context length.

Printed: max_context_tokens, turns, unique_tokens (tree rows of the group's TrainSample), kafka_bytes (keys and
values of every topic of the run's broker: the input and output topics and the processors' changelogs, which
here hold only this group; kafka_bytes_read_marks of it are the processors' read marks, keyed by partition, not by
group, so not counted on a given broker), kafka_bytes_per_unique_token, claim_bytes (a TrainSample too large for Kafka is stored
by reference: forge_stream.events.claims), gateway_overhead_ms_p50_small (turns at 0.5K to 2K tokens of context)
and _long (turns within 10% of the longest context), sample_latency_ms (last session finished -> sample on
forge.samples), train_step_s and trained; and the same run at half the turns (`half`) for the linearity check.
Given `--bootstrap-servers`, it writes one group with a fresh id and counts only records keyed by it.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx
import orjson

from forge_stream.bench import bench_kafka
from forge_stream.events import now_ms
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice, topic_bytes
from forge_stream.kafka.producer import EventProducer
from forge_stream.processors.store import MARK
from forge_stream.proc import running
from forge_stream.topics import TOPICS

SYSTEM = "You are a long-horizon agent. Use the shell tool; summarize when asked."
TOOLS = [{"type": "function", "function": {"name": "shell", "description": "Run a command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
WORDS = ("build", "test", "error", "line", "file", "module", "passed", "failed", "import", "value", "stack",
         "trace", "kafka", "offset", "commit", "tensor", "grad", "shape", "token", "cache")


def _text(rng: random.Random, n: int) -> str:
    """About n bytes of log-like text (the scripted engine's tokens are bytes)."""
    out: list[str] = []
    size = 0
    while size < n:
        word = rng.choice(WORDS) + (f"_{rng.randrange(1000)}" if rng.random() < 0.3 else "")
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n]


class Agent:
    """One scripted session: appends, resets, and times each turn through the gateway and directly."""

    def __init__(self, gateway: str, engine: str, session: dict, seed: int, append_tokens: int):
        self.http = httpx.Client(timeout=120)
        self.url = f"{gateway}{session['path']}/chat/completions"
        self.engine = f"{engine}/v1/chat/completions"
        self.rng = random.Random(seed)
        self.append_tokens = append_tokens
        self.task = f"Task {seed}: fix the failing build. " + _text(self.rng, 400)
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.task}]
        self.turns: list[dict] = []  # per call: prompt tokens, gateway and direct latency

    def call(self, messages: list[dict]) -> dict:
        body = {"model": "scripted", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        start = time.perf_counter()
        direct = self.http.post(self.engine, content=orjson.dumps({**body, "return_token_ids": True,
                                                                    "logprobs": True}))
        direct_ms = (time.perf_counter() - start) * 1000
        direct.raise_for_status()
        start = time.perf_counter()
        answer = self.http.post(self.url, content=orjson.dumps(body))
        gateway_ms = (time.perf_counter() - start) * 1000
        if answer.status_code != 200:
            raise RuntimeError(f"gateway answered {answer.status_code} at turn {len(self.turns)}: {answer.text[:500]}")
        out = answer.json()
        self.turns.append({"prompt_tokens": out["usage"]["prompt_tokens"], "gateway_ms": gateway_ms,
                           "direct_ms": direct_ms})
        return out["choices"][0]["message"]

    def step(self, reset: bool) -> None:
        if reset:
            summary = self.call(self.messages + [{"role": "user", "content": "Summarize the work so far."}])
            self.messages = [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{self.task}\nSummary so far: {summary['content'] or ''}"}]
            return
        reply = self.call(self.messages)
        self.messages.append({k: v for k, v in reply.items() if k in ("role", "content", "tool_calls") and v})
        payload = _text(self.rng, self.append_tokens)
        if reply.get("tool_calls"):
            self.messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": payload})
        else:
            self.messages.append({"role": "user", "content": payload})


def _group(gateway: str, engine: str, kafka: str, group: str, sessions: int, turns: int, resets: tuple[int, ...],
           append_tokens: int, progress) -> tuple[list[Agent], int]:
    producer = EventProducer(kafka)
    producer.send_sync(TOPICS.tasks, group, {
        "event_id": f"task-{group}", "event_time": now_ms(), "task_id": "long-horizon", "group_id": group, "seq": 0,
        "domain": "agent", "grader": "bench", "group_size": sessions, "prompt_json": "{}", "metadata": {}})
    producer.close()
    agents = []
    for g in range(sessions):
        created = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group, "task_id": "long-horizon"}).json()
        agent = Agent(gateway, engine, created, seed=g, append_tokens=append_tokens)
        for k in range(turns):
            agent.step(reset=k in resets)
            if progress and (k + 1) % 50 == 0:
                progress(f"session {g}: {k + 1}/{turns} turns, context {agent.turns[-1]['prompt_tokens']} tokens")
        base = f"{gateway}/v1/sessions/{created['session_id']}"
        httpx.post(f"{base}/reward", json={"value": float(g % 2)}).raise_for_status()
        httpx.post(f"{base}/finish", json={"status": "ok"}).raise_for_status()
        agents.append(agent)
    return agents, now_ms()


def _wait_sample(kafka: str, group: str, timeout_s: float) -> tuple[str, dict, int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in read_slice(kafka, TOPICS.samples, Slice()):
            if event.record["group_id"] == group:
                return event.schema, event.record, event.timestamp_ms
        time.sleep(0.5)
    raise TimeoutError(f"no sample for {group} on {TOPICS.samples.name} within {timeout_s:.0f}s: see the "
                       f"processors' log")


def _train(sample: dict, work: Path) -> dict:
    """One tree-packed CISPO step on the tiny model, in a child process (its peak memory is measured, and running
    out of memory there is a result, not the end of the benchmark)."""
    import multiprocessing

    from forge_stream.events import encode

    path = work / "sample.avro"
    path.write_bytes(encode("TrainSample", sample))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_train_child, args=(str(path), str(work / "model"), results))
    start = time.perf_counter()
    child.start()
    child.join()
    out = results.get() if child.exitcode == 0 else {
        "trained": False, "train_error": f"the training step's process ended with {child.exitcode}"
                                         f"{' (killed: out of memory?)' if child.exitcode == -9 else ''}"}
    out["train_process_s"] = round(time.perf_counter() - start, 1)
    return out


def _train_child(sample_path: str, model_dir: str, results) -> None:
    import resource

    import torch
    from transformers import AutoModelForCausalLM

    from forge_stream.tiny.model import TinyModelSpec, init_tiny_model
    from forge_stream.events import decode
    from forge_stream.trainer.step import StepConfig, build_optimizer, train_step

    _, sample = decode(Path(sample_path).read_bytes())
    longest = max(ref["length"] for ref in sample["sequences"])
    init_tiny_model(Path(model_dir), TinyModelSpec(max_position_embeddings=max(2048, 1 << longest.bit_length())))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = StepConfig(lr=1e-5)
    start = time.perf_counter()
    stats = train_step(model, build_optimizer(model, config), [sample], config, policy_version=0,
                       progress=lambda line: print(f"training: {line}", file=sys.stderr, flush=True))
    results.put({"train_step_s": round(time.perf_counter() - start, 1), "loss": stats.loss,
                 "grad_norm": stats.grad_norm, "micro_batches": stats.micro_batches,
                 "train_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                 "trained": stats.loss_tokens > 0 and all(map(math.isfinite, (stats.loss, stats.grad_norm)))})


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def measure(bootstrap: str | None, sessions: int, turns: int, resets: tuple[int, ...], append_tokens: int,
            train: bool, claim_over_bytes: int = 1024 * 1024, progress=None) -> dict:
    from forge_stream.events.claims import redeem

    with tempfile.TemporaryDirectory(prefix="forge-bench-long-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        kafka = stack.enter_context(bench_kafka(bootstrap, work))
        engine_port, gateway_port = free_port(), free_port()
        engine = f"http://127.0.0.1:{engine_port}"
        gateway = f"http://127.0.0.1:{gateway_port}"
        stack.enter_context(running([sys.executable, "-m", "forge_stream.bench.scripted", "--port",
                                     str(engine_port), "--reply", "Noted; continuing with the next step.",
                                     "--tool-call",
                                     '<tool_call>{"name": "shell", "arguments": {"cmd": "make test"}}</tool_call>'],
                                    url=f"{engine}/health", log=work / "engine.log", stop_timeout=10))
        stack.enter_context(running(
            [sys.executable, "-c", "from forge_stream.cli import main; main()", "gateway", "serve", "--engine", engine,
             "--port", str(gateway_port), "--bootstrap-servers", kafka],
            url=f"{gateway}/health", log=work / "gateway.log", stop_timeout=10))
        run = uuid.uuid4().hex[:8]  # a given cluster may hold other groups: this run's records carry its id
        log = work / "processors.log"
        stack.enter_context(running(  # ready once assigned with its table restored: it starts at the topics' end
            [sys.executable, "-c", "from forge_stream.cli import main; main()", "processors", "run",
             "--bootstrap-servers", kafka, "--data-dir", str(work / "processors"), "--group-timeout-s", "3600",
             "--app-id", f"bench-long-{run}", "--offset-reset", "latest", "--claim-over-bytes", str(claim_over_bytes)],
            name="processors", check=lambda: "Worker]: Ready" in log.read_text(errors="replace"), log=log,
            timeout=180, stop_timeout=10))
        group = f"long-{turns}-{run}"
        agents, finished_ms = _group(gateway, engine, kafka, group, sessions, turns, resets, append_tokens, progress)
        schema, record, written_ms = _wait_sample(kafka, group, timeout_s=600)
        sample = redeem(record) if schema == "SampleClaim" else record
        per_topic = {t: b for t, b in sorted(topic_bytes(kafka, group.encode()).items()) if b}
        # the processors' read marks (one record per input record folded, keyed by partition, not by group): this
        # group is the only one on the bench's broker, so they are its own, and counted with it
        needle = json.dumps(MARK)[1:-1].encode()  # the table's keys are JSON: the mark's character escaped
        marks = sum(topic_bytes(kafka, needle).values()) if bootstrap is None else 0
        calls = [t for a in agents for t in a.turns]
        longest = max(t["prompt_tokens"] for t in calls)
        out = {
            "sessions": sessions, "turns": turns, "calls": len(calls), "resets": len(resets),
            "max_context_tokens": longest,
            "unique_tokens": sample["unique_tokens"], "total_tokens": sample["total_tokens"],
            "kafka_bytes": sum(per_topic.values()) + marks, "kafka_bytes_read_marks": marks,
            "sample_schema": schema, "claim_bytes": record.get("size_bytes", 0),
            "gateway_overhead_ms_p50_small": _p50([t["gateway_ms"] - t["direct_ms"] for t in calls
                                                   if 500 <= t["prompt_tokens"] <= 2000]),
            "gateway_overhead_ms_p50_long": _p50([t["gateway_ms"] - t["direct_ms"] for t in calls
                                                  if t["prompt_tokens"] >= 0.9 * longest]),
            "sample_latency_ms": written_ms - finished_ms,
        }
        out["kafka_bytes_per_unique_token"] = round(out["kafka_bytes"] / out["unique_tokens"], 2)
        out["kafka_topics"] = per_topic
        if progress:
            progress(f"data plane: {orjson.dumps(out).decode()}")
        if train:
            if progress:
                progress(f"training one step on {sample['unique_tokens']} tree rows")
            out.update(_train(sample, work))
        return out


def run(bootstrap: str | None = None, sessions: int = 2, turns: int = 220, append_tokens: int = 1000,
        resets: tuple[int, ...] = (10, 20), half: bool = True, train: bool = True,
        claim_over_bytes: int = 1024 * 1024, progress=None) -> dict:
    """The full run, and (with `half`) the same at half the turns, for `kafka_bytes_per_unique_token`'s linearity."""
    result = measure(bootstrap, sessions, turns, resets, append_tokens, train, claim_over_bytes, progress)
    if half:
        small = measure(bootstrap, sessions, turns // 2, resets, append_tokens, False, claim_over_bytes, progress)
        result["half"] = {k: small[k] for k in ("turns", "max_context_tokens", "unique_tokens", "kafka_bytes",
                                                "kafka_bytes_per_unique_token")}
        result["bytes_per_token_half_ratio"] = round(result["kafka_bytes_per_unique_token"]
                                                     / small["kafka_bytes_per_unique_token"], 3)
    result["targets"] = {
        "max_context_tokens >= 200000": result["max_context_tokens"] >= 200_000,
        "turns >= 200": result["turns"] >= 200,
        "kafka_bytes_per_unique_token <= 64": result["kafka_bytes_per_unique_token"] <= 64,
        "same within 20% at half the turns": abs(result.get("bytes_per_token_half_ratio", 1.0) - 1) <= 0.2,
        "overhead long <= 3x small": (result["gateway_overhead_ms_p50_long"] or 0)
        <= 3 * max(result["gateway_overhead_ms_p50_small"] or 0, 1e-9),
        "trained": bool(result.get("trained")),
    }
    return result
