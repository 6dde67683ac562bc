"""`forge-stream bench engine`: decode throughput of the local engine, one request at a time vs batched.

Builds the tiny model in a temporary directory (or uses `model_dir`), runs `requests` greedy requests of
`max_tokens` tokens through the batcher first one by one, then all at once, and reports tokens per second.
Then agent-shaped requests (the task suite's system prompt, tools and question, about 250 prompt tokens, up to
32 sampled tokens), all at once, with the prefix cache off and on: requests per second of each.
"""

import tempfile
import threading
import time
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.engine.torch_engine.batcher import Batcher, LoadedModel, Request, TokenEvent
from forge_stream.engine.torch_engine.sampling import SamplingParams
from forge_stream.tiny.model import init_tiny_model


def _run_all(batcher: Batcher, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    done = threading.Semaphore(0)
    produced = [0]

    def sink(event) -> None:
        if isinstance(event, TokenEvent):
            produced[0] += 1
            if event.finish_reason:
                done.release()

    started = time.perf_counter()
    for prompt in prompts:
        batcher.submit(Request(prompt, params, 1, sink))
    for _ in prompts:
        done.acquire()
    return produced[0], time.perf_counter() - started


def run(requests: int = 16, max_tokens: int = 64, model_dir: str | None = None, agent_requests: int = 256) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(model_dir) if model_dir else Path(tmp) / "tiny"
        if not model_dir:
            init_tiny_model(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        batcher = Batcher(LoadedModel(model, 0, str(path)),
                          decode=lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
                          eos_ids={tokenizer.eos_token_id}, max_batch_size=requests, max_model_len=4096)
        batcher.start()
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        prompts = [tokenizer.encode(f"Request {i}: the agent reads the weather report.") for i in range(requests)]
        _run_all(batcher, prompts[:2], params)
        one_tokens, one_s = 0, 0.0
        for prompt in prompts:
            tokens, seconds = _run_all(batcher, [prompt], params)
            one_tokens, one_s = one_tokens + tokens, one_s + seconds
        batch_tokens, batch_s = _run_all(batcher, prompts, params)
        batcher.stop()
        agent_rates = {}
        for cache_tokens in (0, 65536):
            agent = Batcher(LoadedModel(model, 0, str(path)),
                            decode=lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip),
                            eos_ids={tokenizer.eos_token_id}, max_batch_size=64, max_model_len=4096,
                            prefix_cache_tokens=cache_tokens)
            agent.start()
            chat = _agent_prompts(tokenizer, agent_requests)
            _, seconds = _run_all(agent, chat, SamplingParams(max_tokens=32, temperature=1.0, seed=0))
            agent.stop()
            agent_rates[cache_tokens] = len(chat) / seconds
    return {
        "requests": requests,
        "max_tokens": max_tokens,
        "sequential_tokens_per_s": round(one_tokens / one_s, 1),
        "batched_tokens_per_s": round(batch_tokens / batch_s, 1),
        "speedup": round((batch_tokens / batch_s) / (one_tokens / one_s), 2),
        "max_batch": batcher.stats.max_batch,
        "agent_requests": agent_requests,
        "agent_requests_per_s_no_prefix_cache": round(agent_rates[0], 1),
        "agent_requests_per_s_prefix_cache": round(agent_rates[65536], 1),
        "prefix_cache_speedup": round(agent_rates[65536] / agent_rates[0], 2),
    }


def _agent_prompts(tokenizer, n: int) -> list[list[int]]:
    from forge_stream.tasks.suite import SYSTEM, TOOLS, make_tasks

    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt["question"]}],
        tools=TOOLS, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
        for task in make_tasks("train", n)]
