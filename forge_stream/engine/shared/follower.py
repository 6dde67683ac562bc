"""How an engine follows the trainer: one loop, for the torch engine (forge_stream.engine.torch_engine.api) and for
vLLM (forge_stream.engine.vllm_front.app), that reads `forge.policy` and moves the engine to each newer version through
the engine's own `apply` (torch: load the checkpoint; vLLM: hold it, reload and prove it,
forge_stream.engine.vllm_front.load).

The loop reads the topic from the beginning without a consumer group (every engine replica must see every version,
forge_stream.kafka.follow) and keeps the versions of one training run (the record key). What it applies:

- **The newest, never backwards** (`newest`): of all that was published up to now, the highest version above the
  served one, or the served one re-published with another checkpoint (a step the trainer re-ran after a crash).
  The versions between are skipped: a load takes seconds, a trainer may publish faster.
- **At most every `interval_s`** after a version whose weights were loaded (one announced on the served weights
  costs nothing and does not count): the newest of all published meanwhile is next.

Supervised: whatever an `apply` raises, the version is not served; the engine's apply has already undone its part
(reopened its gate, resumed vLLM, loaded the served weights back, or ended the process when it could not), and the
loop logs one line saying why, counts it, and goes on serving the last proven version until a newer one comes. If the
loop itself ends (a bug, Kafka's client failing for good), `FollowerStatus.stopped` says why and the engine's
/health answers 503 with that reason: `forge-stream status` shows the engine unhealthy, a balancer takes it out, and
restarting it starts a fresh follower. While Kafka is away the engine serves on; the loop catches up.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Awaitable, Callable
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from forge_stream.kafka.follow import Follower
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)

MAX_WHY = 600  # characters of a failure's message in its log line
SWITCHES_KEPT = 1000  # FollowerStatus.switch_s: the versions /health summarises


@dataclass(frozen=True)
class Applied:
    """A version an engine serves now: `loaded` if its weights were loaded (False: announced on the served weights,
    which were byte for byte its own), and the rest of the log line that says how."""

    loaded: bool
    detail: str


class NotServed(Exception):
    """An apply that failed for a reason it can say in words (the checkpoint is unreadable, the proof did not hold);
    the message ends the follower's log line."""


Apply = Callable[[str, int], Awaitable[Applied]]  # (checkpoint, version) -> Applied; raises when not served
Served = Callable[[], tuple[int, str]]  # the version the engine serves and its checkpoint, as published


@dataclass
class FollowerStatus:
    """What the engine's /health says of its follower."""

    loads: int = 0  # versions whose weights were loaded
    renamed: int = 0  # versions announced on the served weights, without a load
    failed: int = 0  # versions not served (unreadable, refused, not proven)
    stopped: str | None = None  # why the follower no longer runs: /health is then not ok
    # seconds from each served version's publication (its PolicyVersion's event_time) to the engine serving it,
    # the last SWITCHES_KEPT: the trainer's clock against this host's, so across hosts it holds their skew too
    switch_s: deque[float] = field(default_factory=lambda: deque(maxlen=SWITCHES_KEPT))

    def health(self) -> dict:
        switches = sorted(self.switch_s)
        return {"loads": self.loads, "failed_loads": self.failed, "renamed_versions": self.renamed,
                "switch_s": {"median": round(median(switches), 3), "max": round(switches[-1], 3),
                             "versions": len(switches)} if switches else None}


def newest(records: list[dict], current: int, current_path: str | None = None) -> dict | None:
    """The PolicyVersion to load from a batch: the last-published record of the highest version, if it is
    above `current`, or is `current` re-published with other weights (a trainer re-ran a step after a crash)."""
    if not records:
        return None
    top = max(r["version"] for r in records)
    latest = [r for r in records if r["version"] == top][-1]
    if top > current or (top == current and latest["checkpoint_uri"] != current_path):
        return latest
    return None


async def follow(bootstrap: str, run: str, served: Served, apply: Apply, status: FollowerStatus,
                 interval_s: float = 0.0, poll_ms: int = 500) -> None:
    """Apply each newer version of training run `run` until cancelled (see the module docstring)."""
    async with Follower(bootstrap, TOPICS.policy, run, poll_ms) as policy:
        pending = await policy.backlog()
        load_after = 0.0  # time.monotonic() before which no load starts
        while True:
            target = newest(pending, *served())
            if target is not None and time.monotonic() < load_after:
                await asyncio.sleep(load_after - time.monotonic())
                target = newest([target, *await policy.caught_up()], *served())
            if target is not None and await _apply(target, served, apply, status):
                load_after = time.monotonic() + interval_s
            pending = await policy.caught_up() or await policy.next()


async def _apply(record: dict, served: Served, apply: Apply, status: FollowerStatus) -> bool:
    """Apply the version of PolicyVersion `record`, counting, timing and logging how it went; True if its weights were
    loaded."""
    checkpoint, version = record["checkpoint_uri"], record["version"]
    try:
        applied = await apply(checkpoint, version)
    except Exception as exc:
        status.failed += 1
        log.warning("policy version %s at %s is not served: %s; still serving version %s", version, checkpoint,
                    _why(exc), served()[0])
        return False
    if applied.loaded:
        status.loads += 1
    else:
        status.renamed += 1
    published, since = record.get("event_time"), ""
    if published:
        delay = max(0.0, time.time() - published / 1000)
        status.switch_s.append(delay)
        since = f"; {delay:.2f}s after it was published"
    log.info("serving policy version %s from %s: %s%s", version, checkpoint, applied.detail, since)
    return applied.loaded


def _why(exc: Exception) -> str:
    """An apply's failure in one line: a NotServed's own words; anything else by its type, message and where it was
    raised (for a bug report: the follower logs no traceback for a version it could not serve)."""
    said = " ".join(str(exc).split())  # one line, whatever the message (transformers' span several)
    if len(said) > MAX_WHY:
        said = said[:MAX_WHY] + "..."
    if isinstance(exc, NotServed):
        return said
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__} {said}{where}"


def supervise(follower: Awaitable[None], status: FollowerStatus) -> asyncio.Task:
    """Run `follower` as a task; if it ends other than by being cancelled, `status.stopped` says why."""
    task = asyncio.ensure_future(follower)

    def ended(task: asyncio.Task) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        status.stopped = (f"the policy follower stopped ({type(exc).__name__}: {exc}); restart the engine"
                          if exc is not None else "the policy follower returned; restart the engine")
        log.error("%s: it no longer loads new policy versions", status.stopped, exc_info=exc)

    task.add_done_callback(ended)
    return task
