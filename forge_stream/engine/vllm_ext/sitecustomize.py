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
TOOL_PARSER_LOGGER = "vllm.tool_parsers.hermes_tool_parser"
TOOL_PARSER_FAILURES = ("Error in extracting tool call from response.", "Error trying to handle streaming tool call.")


def _patch(module) -> None:
    seconds = float(os.environ[ENV])

    def poll_pause() -> None:
        time.sleep(seconds)

    module.sched_yield = poll_pause  # the module's waits call it by this name on each turn of their loops
    module.forge_poll_s = seconds  # read back by the worker extension's `forge_mq_poll`


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of MODULE so that `_patch` runs once the module has executed."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

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
if os.environ.get(ENV):
    sys.meta_path.insert(0, _PatchOnImport())
