"""`forge-stream bench engine --engine vllm`: real vLLM and the local torch engine side by side, over HTTP.

Both engines serve the same model at once (`engine vllm` and `engine serve`, each its own process) and get the
same agent-shaped chat requests: the task suite's system prompt, tools and a question (about 250 prompt tokens),
32 sampled tokens at temperature 1 (EOS ignored, so both engines produce the same number), log-probs and token ids
asked for, as the gateway asks. Phases alternate
between the engines (vllm, torch, vllm, torch, ...) at 1 and at 64 requests in flight, so a slow spell of the
shared machine lands on both; each engine's figure is the median of its phases. Only the measured engine works
during a phase (the other is idle).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from forge_stream.engine.shared.process import EngineProcess


def agent_messages(n: int) -> list[list[dict]]:
    from forge_stream.tasks.suite import SYSTEM, make_tasks

    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt["question"]}]
            for task in make_tasks("train", n)]


async def _phase(url: str, requests: list[list[dict]], in_flight: int, max_tokens: int) -> dict:
    from forge_stream.tasks.suite import TOOLS

    limit = asyncio.Semaphore(in_flight)
    latencies: list[float] = []
    tokens = [0]

    async def one(client: httpx.AsyncClient, messages: list[dict]) -> None:
        async with limit:
            began = time.perf_counter()
            response = await client.post(f"{url}/v1/chat/completions", json={
                "model": "bench", "messages": messages, "tools": TOOLS, "max_tokens": max_tokens,
                "temperature": 1.0, "logprobs": True, "return_token_ids": True, "ignore_eos": True})
            if response.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {response.status_code} {response.text[:300]}")
            latencies.append(time.perf_counter() - began)
            tokens[0] += response.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=in_flight + 8)) as client:
        began = time.perf_counter()
        await asyncio.gather(*(one(client, m) for m in requests))
        seconds = time.perf_counter() - began
    return {"requests_per_s": len(requests) / seconds, "tokens_per_s": tokens[0] / seconds,
            "p50_ms": statistics.median(latencies) * 1000}


def run(model_dir: str | None = None, requests: int = 256, rounds: int = 2, max_tokens: int = 32,
        log_dir: Path | None = None, progress=print) -> dict:
    """Start both engines on the model (default: the tiny demo model, made here), alternate phases, report."""
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        if model_dir is None:
            from forge_stream.tiny.model import init_tiny_model

            model_dir = str(Path(tmp) / "tiny")
            init_tiny_model(Path(model_dir))
        logs = Path(log_dir or tmp)
        progress(f"starting vLLM and the torch engine on {model_dir} (vLLM takes about two minutes)...")
        engines = {
            "vllm": stack.enter_context(EngineProcess(model_dir, kind="vllm", log_path=logs / "vllm.log",
                                                      extra_args=("--max-batch-size", "64"))),
            "torch": stack.enter_context(EngineProcess(model_dir, log_path=logs / "torch.log",
                                                       extra_args=("--max-batch-size", "64"))),
        }
        chats = agent_messages(requests)
        phases: dict[str, dict[str, list[dict]]] = {name: {"1": [], "64": []} for name in engines}
        for name, engine in engines.items():  # warm-up: both engines have served this shape before timing
            asyncio.run(_phase(engine.url, chats[:8], 8, max_tokens))
        for round_ in range(rounds):
            for in_flight, batch in ((1, chats[:max(8, requests // 16)]), (64, chats)):
                for name, engine in engines.items():
                    result = asyncio.run(_phase(engine.url, batch, in_flight, max_tokens))
                    phases[name][str(in_flight)].append(result)
                    progress(f"round {round_ + 1}/{rounds} {name} at {in_flight} in flight: "
                             f"{result['requests_per_s']:.1f} requests/s, p50 {result['p50_ms']:.0f} ms")
    report = {name: {k: {m: round(statistics.median(p[m] for p in runs), 2) for m in runs[0]}
                     for k, runs in by_flight.items()} for name, by_flight in phases.items()}
    return {"model": model_dir, "requests": requests, "max_tokens": max_tokens, "rounds": rounds, "engines": report,
            "vllm_over_torch_at_64": round(report["vllm"]["64"]["requests_per_s"]
                                           / report["torch"]["64"]["requests_per_s"], 2),
            "phases": phases}
