"""How an agent is launched for one session: a command line (any language), or any `Agent` (a coroutine function of
the session's context that returns an AgentResult).

The agent only learns an OpenAI base URL and key (OPENAI_BASE_URL, OPENAI_API_KEY: its session's token, never the
deployment's) and its task (FORGE_TASK_JSON, also on stdin); whatever it prints on stdout is its output for the
grader. The controller's own tokens (FORGE_GATEWAY_ADMIN_TOKEN, FORGE_ENGINE_TOKEN) are taken out of the
environment it inherits.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
from dataclasses import dataclass
from typing import Awaitable, Protocol

from forge_stream.credentials import agent_env


@dataclass(frozen=True)
class AgentContext:
    session_id: str
    base_url: str
    api_key: str
    task: dict  # the Task's prompt payload (never its reference: the answer stays with the grader)


@dataclass(frozen=True)
class AgentResult:
    output: str
    ok: bool
    reason: str | None = None


class Agent(Protocol):
    def __call__(self, ctx: AgentContext) -> Awaitable[AgentResult]: ...


@dataclass(frozen=True)
class CommandAgent:
    """Run `command` once per session with the OpenAI environment set; stdout is the output.

    The agent runs in its own process session: a signal to the controller's process group (Ctrl-C, `forge-stream
    down`) lets it finish its episode while the controller stops gracefully."""

    command: str
    timeout_s: float = 600.0

    async def __call__(self, ctx: AgentContext) -> AgentResult:
        env = {**agent_env(os.environ), "OPENAI_BASE_URL": ctx.base_url, "OPENAI_API_KEY": ctx.api_key,
               "FORGE_SESSION_ID": ctx.session_id, "FORGE_TASK_JSON": json.dumps(ctx.task)}
        proc = await asyncio.create_subprocess_exec(
            *shlex.split(self.command), env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(json.dumps(ctx.task).encode()), self.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            return AgentResult("", False, f"agent timed out after {self.timeout_s:.0f}s")
        except asyncio.CancelledError:  # the controller aborts: take the agent down with it
            proc.kill()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            return AgentResult(out.decode(errors="replace"), False,
                               f"agent exited with {proc.returncode}: {' | '.join(tail)}")
        return AgentResult(out.decode(errors="replace"), True)

