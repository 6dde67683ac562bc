"""What the windowed FIFO says it waits for: one line for people (the trainer's log, `forge-stream status`) and the
small state file through which `status`, another process, reads it.

A view (`WindowedConsumer.view`) is plain JSON: the run, the trainer's pid, when it was taken, the window and what
is queued, and the *head*: the oldest group not yet finished, which bounds what the window may hand out, with how long
it has waited, what it misses (its sample; how many of its sessions opened and finished, read from forge.sessions)
and when the trainer's backstop skips it. The trainer writes its run's view to `<home>/run/windows/<run>.json`
(replaced in one step, so a reader never sees half a file) every few seconds while it waits for a batch, and removes
it when it stops.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from forge_stream.proc import alive

WAIT_SAY_S = 10.0  # a head that has waited longer than this is logged, and its sessions looked up


def view_file(run_dir: Path, run: str) -> Path:
    """Where the trainer of `run` keeps its view, under a home's run directory."""
    return run_dir / "windows" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', run)}.json"


def write_view(path: Path, view: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(view))
    os.replace(tmp, path)


def read_views(run_dir: Path) -> dict[str, dict]:
    """Each run's view found under `run_dir`, by run, with `trainer_running` (whether the pid that wrote it lives)."""
    views = {}
    for path in sorted((run_dir / "windows").glob("*.json")):
        try:
            view = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # removed as it was read
        views[view["run"]] = {**view, "trainer_running": alive(view.get("pid"))}
    return views


def missing(head: dict) -> str:
    """What the head group misses, in words.

    >>> missing({"group_size": 4, "sessions": {"started": 3, "finished": 1}})
    'its sample: 1 of its 4 sessions finished (2 open, 1 never opened)'
    >>> missing({"group_size": 2, "sessions": {"started": 2, "finished": 2}})
    'its sample: its 2 sessions all finished, so the processors should have closed it (are they running?)'
    >>> missing({"group_size": 2, "sessions": None})
    'its sample from the processors'
    """
    sessions, size = head["sessions"], head["group_size"]
    if sessions is None:
        return "its sample from the processors"
    started, finished = sessions["started"], sessions["finished"]
    if finished >= size:
        return (f"its sample: its {size} sessions all finished, so the processors should have closed it (are they "
                "running?)")
    return (f"its sample: {finished} of its {size} sessions finished ({started - finished} open, "
            f"{size - started} never opened)")


def line(view: dict, now_ms: int | None = None) -> str:
    """The view in one line.

    >>> head = {"group_id": "g1", "task_id": "t1", "seq": 5, "waited_s": 42.0, "group_size": 2,
    ...         "sessions": {"started": 0, "finished": 0}, "skip_at_ms": 1_000_000}
    >>> line({"run": "default", "window": 3, "queued": 4, "held": 2, "step": 0, "head": head}, now_ms=100_000)
    'run default: the window (3 groups) waits on group g1 (task t1) for 42 s, missing its sample: 0 of its 2 \
sessions finished (0 open, 2 never opened); 2 finished groups wait behind it; the trainer skips it in 900 s if no \
event of it comes (the processors cut it sooner once it is idle for their --group-timeout-s)'
    >>> line({"run": "default", "window": None, "queued": 0, "held": 0, "step": 3, "head": None})
    'run default: nothing to wait on (0 groups queued, 0 finished, 3 steps trained)'
    """
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    head, window = view["head"], view["window"]
    if head is None:
        return (f"run {view['run']}: nothing to wait on ({view['queued']} groups queued, {view['held']} finished, "
                f"{view['step']} steps trained)")
    size = "unbounded" if window is None else f"{window} groups"
    skip_s = max(0.0, (head["skip_at_ms"] - now_ms) / 1000)
    return (f"run {view['run']}: the window ({size}) waits on group {head['group_id']} (task {head['task_id']}) for "
            f"{head['waited_s']:.0f} s, missing {missing(head)}; {view['held']} finished groups wait behind it; the "
            f"trainer skips it in {skip_s:.0f} s if no event of it comes (the processors cut it sooner once it is idle "
            "for their --group-timeout-s)")
