"""The engine follows `forge.policy`: each newer PolicyVersion's checkpoint is loaded with `load_weights`.

The watcher reads the topic from the beginning without a consumer group (every engine replica must see every
version), skips to the newest version of each batch it reads, and never goes backwards; a version re-published
with another checkpoint (a step the trainer re-ran after a crash) replaces the weights of that version. Requests in flight finish
on the weights they started with. A version whose checkpoint cannot be loaded (rotated away, unreadable) is
skipped with a warning: the engine keeps serving what it has and loads the next version that comes. While Kafka is
away the engine serves on; the watcher (forge_stream.kafka.follow) reconnects and catches up.
"""

from __future__ import annotations

import logging

from forge_stream.engine.serving import EngineRequestError
from forge_stream.kafka.follow import Follower
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


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


async def watch_policy(engine, bootstrap: str, run: str = "default", poll_ms: int = 500) -> None:
    """Run until cancelled, loading each newer policy version of training run `run` (the record key) into
    `engine`; other runs' versions (a replay, an experiment) are ignored."""
    async with Follower(bootstrap, TOPICS.policy, run, poll_ms) as policy:
        while True:
            target = newest(await policy.next(), engine.policy_version, engine.scheduler.current.path)
            if target is None:
                continue
            try:
                result = await engine.load_weights(target["checkpoint_uri"], target["version"])
            except EngineRequestError as exc:  # e.g. the trainer already rotated that checkpoint away
                log.warning("cannot load policy version %s (%s); still serving version %s until a newer one "
                            "loads", target["version"], exc, engine.policy_version)
                continue
            log.info("loaded policy version %s from %s in %.2fs", result.policy_version, result.path,
                     result.load_seconds)
