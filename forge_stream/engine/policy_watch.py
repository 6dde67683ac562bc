"""The engine follows `forge.policy`: each newer PolicyVersion's checkpoint is loaded with `load_weights`.

The watcher reads the topic from the beginning without a consumer group (every engine replica must see every
version), skips to the newest version of each batch it reads, and never goes backwards; a version re-published
with another checkpoint (a step the trainer re-ran after a crash) replaces the weights of that version. Requests in flight finish
on the weights they started with. A version whose checkpoint cannot be loaded (rotated away, unreadable) is
skipped with a warning: the engine keeps serving what it has and loads the next version that comes. While Kafka is
away the engine serves on; the watcher reconnects (aiokafka) and catches up.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from forge_stream.engine.serving import EngineRequestError
from forge_stream.events import DecodeError, decode
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


def run_records(batches: dict, run: str) -> list[dict]:
    """The decoded PolicyVersion records of training run `run` in a batch from aiokafka's `getmany`."""
    records = []
    for messages in batches.values():
        for message in messages:
            if message.key != run.encode():
                continue
            try:
                records.append(decode(message.value)[1])
            except DecodeError as exc:
                log.warning("skipping an undecodable forge.policy record at offset %s: %s", message.offset, exc)
    return records


async def watch_policy(engine, bootstrap: str, run: str = "default", poll_ms: int = 500) -> None:
    """Run until cancelled, loading each newer policy version of training run `run` (the record key) into
    `engine`; other runs' versions (a replay, an experiment) are ignored."""
    while True:  # Kafka away at start: keep serving the weights there are, and try again
        consumer = AIOKafkaConsumer(TOPICS.policy.name, bootstrap_servers=bootstrap, group_id=None,
                                    auto_offset_reset="earliest", enable_auto_commit=False)
        try:
            await consumer.start()
            break
        except KafkaError as exc:
            log.warning("cannot reach Kafka at %s to follow forge.policy (%s); retrying", bootstrap, exc)
            await consumer.stop()
            await asyncio.sleep(2.0)
    try:
        while True:
            records = run_records(await consumer.getmany(timeout_ms=poll_ms), run)
            target = newest(records, engine.policy_version, engine.scheduler.current.path)
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
    finally:
        await consumer.stop()

