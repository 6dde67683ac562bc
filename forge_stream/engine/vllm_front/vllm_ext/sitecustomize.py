"""Imported at start-up by every Python process of a vLLM server forge-stream starts (this directory is on its
PYTHONPATH): how vLLM's shared-memory message queue polls while it waits, from FORGE_VLLM_MQ_POLL_S.

vLLM 0.32's engine core and its worker exchange every step through that queue. A reader spins (`sched_yield` in a
loop) for a second after each message before it parks on the queue's notification socket
(`SpinCondition.busy_loop_s`, hard-coded; upstream vllm-project/vllm#19036, #52814), and a writer spins until its
readers have taken the last message. Steps come every few milliseconds, so under load both processes spin from the
first token to the last: on a 2-core host one core of the two, taken from the trainer beside vLLM (measured: the
engine core used 57 CPU-s of 60 s serving 16 requests in flight). With the variable set, each turn of those loops
sleeps that long instead of yielding: the queue is polled every FORGE_VLLM_MQ_POLL_S seconds at a few percent of a
core, and when each side parks or wakes is left as vLLM has it. (Parking at once instead, `busy_loop_s=0`, is not
safe: the notification socket drops wake-ups sent while the last one is still queued, and a reader that misses one
sleeps 5 s, its recheck interval; measured on the tiny model: a step every 5 s.)

Unset, nothing is changed. The patch is applied when vLLM imports the module, so a process that never imports it is
untouched.

Always: when the model writes a `<tool_call>` block that does not parse, vLLM's hermes tool parser logs an ERROR
with a traceback and answers the text without tool_calls. For a policy being trained that is the model's mistake,
not the server's: the gateway records why on the Completion (`tool_call_error`) and the `invalid_tool_call` rule
penalizes it. `ModelToolCallNote` turns that record into one WARNING line that says so.

Always: a request with a `seed` gets a generator of its own, and when a step computes only part of its prompt (the
step's token budget, 2048 on a CPU server, is shared by every prompt being read, so under load any prompt can be
split), vLLM rewinds that generator past the token it sampled and threw away, with `set_offset`. A CPU generator has
no offset: torch raises "CPU Generator does not use offset" and vLLM's engine dies with every request in flight. The
model runner's generators are made `RewindableGenerator`s, on which the rewind does nothing on the CPU: a seeded
request then draws on from where the discarded sample left it, so its tokens are repeatable for the same schedule of
its prompt's parts (which the concurrent load decides, as it does on GPUs), and the engine lives.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
import time

MODULE = "vllm.distributed.device_communicators.shm_broadcast"
ENV = "FORGE_VLLM_MQ_POLL_S"
RUNNER = "vllm.v1.worker.gpu_model_runner"  # the CPU model runner is a subclass; it makes the seeded generators
TOOL_PARSER_LOGGER = "vllm.tool_parsers.hermes_tool_parser"
TOOL_PARSER_FAILURES = ("Error in extracting tool call from response.", "Error trying to handle streaming tool call.")


def _patch_poll(module) -> None:
    seconds = float(os.environ[ENV])

    def poll_pause() -> None:
        time.sleep(seconds)

    module.sched_yield = poll_pause  # the module's waits call it by this name on each turn of their loops
    module.forge_poll_s = seconds  # read back by the worker extension's `forge_mq_poll`


def _patch_generators(module) -> None:
    import types

    import torch

    class RewindableGenerator(torch.Generator):
        """A torch generator whose offset, on the CPU where torch has none, reads 0 and sets nothing."""

        def get_offset(self) -> int:
            return 0 if self.device.type == "cpu" else super().get_offset()

        def set_offset(self, offset: int):
            return self if self.device.type == "cpu" else super().set_offset(offset)

    class TorchWithRewindableGenerators(types.ModuleType):
        """torch as the runner module sees it: torch itself, but `Generator` makes RewindableGenerators."""

        Generator = RewindableGenerator

        def __getattr__(self, name):
            return getattr(torch, name)

    module.torch = TorchWithRewindableGenerators("torch")  # the runner's code reads its global `torch` when it runs


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of each module of `patches` so that its patch runs once the
    module has executed."""

    def __init__(self, patches: dict) -> None:
        self.patches = patches

    def find_spec(self, name, path, target=None):
        patch = self.patches.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


class ModelToolCallNote(logging.Filter):
    """Rewrites the hermes parser's ERROR and traceback for a tool call that did not parse as one WARNING line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() in TOOL_PARSER_FAILURES and record.levelno >= logging.ERROR:
            error = record.exc_info[1] if record.exc_info else None
            record.msg = ("the model wrote a <tool_call> block that does not parse (%s); answered as text without "
                          "tool_calls. The gateway records why on the Completion (tool_call_error) and the "
                          "invalid_tool_call rule penalizes it: a mistake of the policy, not of the server")
            record.args = (f"{type(error).__name__}: {error}" if error else "no detail",)
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.exc_info = record.exc_text = None
        return True


logging.getLogger(TOOL_PARSER_LOGGER).addFilter(ModelToolCallNote())
sys.meta_path.insert(0, _PatchOnImport({RUNNER: _patch_generators,
                                       **({MODULE: _patch_poll} if os.environ.get(ENV) else {})}))
