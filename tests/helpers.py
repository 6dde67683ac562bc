"""Helpers shared by test suites: serve an ASGI app on a real port, read back what landed on a topic, run the CLI."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from forge_stream.gateway.wire import CoalescingHttpToolsProtocol
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.topics import Topic


@contextmanager
def serving(app, http=CoalescingHttpToolsProtocol) -> Iterator[str]:
    """Serve an ASGI app on a free port in a thread, with the HTTP protocol `gateway serve` runs (by default);
    yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on", http=http))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def read_events(bootstrap: str, topic: Topic, where: Callable[[dict], bool]) -> list[dict]:
    """Every record of `topic` matching `where`, from the beginning to the current end of each partition (events
    a service acknowledged are all below it). No consumer group is used. Records of a schema the topic does not
    carry (tests/kafka/test_dlq.py writes a Task to forge.rewards) are passed over."""
    return [event.record for event in read_slice(bootstrap, topic, Slice())
            if event.schema in topic.value_schemas and where(event.record)]


def until(probe: Callable[[], object], timeout: float, what: str | Callable[[], str] | None = None):
    """`probe()`'s first truthy value, polled every 0.5 s; AssertionError after `timeout` saying `what` (or, without
    it, the probe's last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    said = what() if callable(what) else what if what is not None else f"last: {probe()}"
    raise AssertionError(f"{said}: not within {timeout:.0f}s")


def cli(env: dict[str, str], *args: str, timeout: float = 180) -> str:
    """`forge-stream ARGS` as a user runs it, in `env`; its stdout, after asserting it exited 0."""
    out = subprocess.run([sys.executable, "-m", "forge_stream", *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def adapter_version(base: Path, out: Path, seed: int, rank: int = 4, scale: float = 0.2) -> Path:
    """A LoRA adapter version of `base` as the trainer writes one (forge_stream.lora), with random non-zero
    weights: the base's log-probs move by tenths of a nat."""
    import torch
    from transformers import AutoModelForCausalLM

    from forge_stream import lora

    model = lora.wrap(AutoModelForCausalLM.from_pretrained(base), rank)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, scale)
    model.save_pretrained(out)
    return out
