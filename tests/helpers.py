"""Helpers shared by test suites: serve an ASGI app on a real port, read back what landed on a topic, run the CLI,
fold what a gateway recorded for a group into its TrainSample, and compare the trainer's log-probs with the recorded
ones."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import uvicorn

from forge_stream.events import decode, deterministic_id, encode
from forge_stream.gateway.wire import CoalescingHttpToolsProtocol
from forge_stream.kafka.broker import free_port
from forge_stream.kafka.history import Slice, read_completions, read_slice
from forge_stream.processors import ProcessorSettings, fold
from forge_stream.topics import TOPICS, Topic
from forge_stream.trainer.step import StepConfig, accumulate_gradients, sample_tree, sampling_settings
from forge_stream.tree import sequence_logprobs
from forge_stream.tree.logprobs import path_logprobs


def needs_haproxy(why: str) -> pytest.MarkDecorator:
    """Skip where HAProxy is not installed, with `why` it is needed; never under CI=true (.ci/run installs it): there
    a missing haproxy fails the test instead of passing it over in silence."""
    missing = shutil.which("haproxy") is None and not os.path.exists("/usr/sbin/haproxy")
    return pytest.mark.skipif(missing and os.environ.get("CI") != "true",
                              reason=f"haproxy is not installed (apt-get install -y haproxy): {why}")


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


def read_events(bootstrap: str, topic: Topic, where: Callable[[dict], bool], since: Slice | None = None
                ) -> list[dict]:
    """Every record of `topic` matching `where`, written since the running test began (or in the slice `since`:
    `Slice()` for every record from the beginning) up to the current end of each partition (events a service
    acknowledged are all below it). No consumer group is used. Records of a schema the topic does not carry
    (tests/kafka/test_dlq.py writes a Task to forge.rewards) are passed over."""
    return [event.record for event in read_slice(bootstrap, topic, since_this_test() if since is None else since)
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


# when the running test began, a second early for the clock's steps (tests/conftest.py sets it before each test)
TEST_STARTED_MS = [0]


def since_this_test() -> Slice:
    """The slice of a topic written since the running test began: the session broker's topics hold every earlier
    test's records too, and a read from their start grows slower through the run. For records of groups and sessions
    the test itself opened."""
    return Slice(start_ms=TEST_STARTED_MS[0])


def group_events(bootstrap: str, group_id: str, group_size: int) -> list[tuple[str, dict]]:
    """A group's events as the processors read them (prompts whole), after a Task for its `group_size` sessions."""
    task = {"event_id": deterministic_id("task", group_id), "event_time": 0, "group_id": group_id, "task_id": "sum",
            "seq": 0, "domain": "math", "grader": "exact_match", "group_size": group_size, "prompt_json": "{}",
            "metadata": {}}
    events = [("Task", task)]
    for topic in (TOPICS.sessions, TOPICS.tool_spans, TOPICS.rewards):
        events += [(e.schema, e.record) for e in read_slice(bootstrap, topic, since_this_test())
                   if e.record.get("group_id") == group_id]
    events += [("Completion", r) for r in read_completions(bootstrap, since_this_test(),
                                                           keep=lambda r: r["group_id"] == group_id)]
    return sorted(events, key=lambda e: e[1]["event_time"])


def folded_train_sample(bootstrap: str, group_id: str, group_size: int) -> dict:
    """The group's TrainSample, folded by the processors from what the gateway recorded, as the trainer reads it
    from forge.samples (through its Avro schema)."""
    state, samples = None, []
    for schema, record in group_events(bootstrap, group_id, group_size):
        state, out = fold(state, schema, record, ProcessorSettings(group_timeout_ms=60_000))
        samples += [e.record for e in out if e.schema == "TrainSample"]
    assert len(samples) == 1, samples
    return decode(encode("TrainSample", samples[0]))[1]


def trainer_gaps(model: torch.nn.Module, sample: dict) -> tuple[dict, float]:
    """The trainer step's stats of a TrainSample (mismatch_max: max |trainer - recorded| log-prob over its
    completion tokens, each scored at its sequence's sampling settings; ratio_max), and the same max gap were
    every token scored at temperature 1, as the trainer once did. The gradients it adds to `model` are cleared."""
    stats = accumulate_gradients(model, [sample], StepConfig())
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        scored = sequence_logprobs(model, sample_tree(sample))
    at_one = max(float((lp[ref["prompt_len"] - 1:] - torch.tensor(ref["old_logprobs"])).abs().max())
                 for lp, ref in zip(scored, sample["sequences"]))
    return stats, at_one


NUCLEUS_EDGE = 2e-5  # top_p either side: past the cumulative-mass noise of an engine's forward, short of a token's mass


def nucleus_edge(model: torch.nn.Module, sample: dict, match: float) -> tuple[torch.Tensor, torch.Tensor]:
    """|trainer - recorded| log-prob of every completion token of a TrainSample (the trainer's own `path_logprobs`,
    at each sequence's recorded settings), and which tokens sit at their nucleus's edge: off by `match` or more, but
    within it once top_p (where below 1) moves NUCLEUS_EDGE either way.

    An engine's forward and the trainer's agree to within float noise (5e-6 nats for the torch engine, 6e-5 for
    vLLM), so a token whose cumulative mass sits that close to 1 - top_p falls inside the nucleus on one side and
    outside on the other, and the renormalised log-probs of its row then differ by about that token's mass: the
    tiny model's 2,048 nearly flat tokens, 5e-4 nats. Moving top_p moves the edge past it, and the trainer's nucleus is
    the engine's again; a wrong temperature or wrong weights stay off whatever the top_p."""
    tree, refs = sample_tree(sample), sample["sequences"]
    rows = torch.cat([path[ref["prompt_len"]:] for path, ref in zip(tree.paths, refs)])
    recorded = torch.tensor([lp for ref in refs for lp in ref["old_logprobs"]], dtype=torch.float64)
    temperature, top_p = sampling_settings(refs, [len(ref["old_logprobs"]) for ref in refs])
    gaps = []
    with torch.no_grad():
        for shift in (0.0, -NUCLEUS_EDGE, NUCLEUS_EDGE):
            moved = torch.where(top_p < 1.0, top_p + shift, top_p)
            scored = path_logprobs(model, tree, rows, temperature=temperature, top_p=moved)
            gaps.append((scored.double() - recorded).abs())
    return gaps[0], (gaps[0] >= match) & (torch.minimum(gaps[1], gaps[2]) < match)


def publish_adapter_version(bootstrap: str, run: str, version: int, folder: Path, rank: int = 4) -> float:
    """Announce a LoRA adapter folder as policy `version` of `run` on forge.policy, as the trainer does; the
    monotonic time it was acknowledged."""
    import uuid

    from forge_stream import lora
    from forge_stream.kafka.producer import EventProducer

    producer = EventProducer(bootstrap)
    producer.send_sync(TOPICS.policy, run, {
        "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version, "step": version,
        "checkpoint_uri": str(folder), "base_model": lora.adapter_base(folder), "lora_rank": rank,
        "size_bytes": lora.weight_bytes(folder)})
    producer.close()
    return time.monotonic()
