"""The engine follows `forge.policy`: each newer PolicyVersion's checkpoint is loaded with `load_weights`.

The watcher reads the topic from the beginning without a consumer group (every engine replica must see every
version), skips to the newest version of each batch it reads, and never goes backwards. Requests in flight finish
on the weights they started with.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer

from forge_stream.events import DecodeError, decode
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


def newest(records: list[dict], current: int) -> dict | None:
    """The PolicyVersion to load from a batch: the highest version above `current`, if any."""
    ahead = [r for r in records if r["version"] > current]
    return max(ahead, key=lambda r: r["version"]) if ahead else None


async def watch_policy(engine, bootstrap: str, poll_ms: int = 500) -> None:
    """Run until cancelled, loading each newer policy version into `engine`."""
    consumer = AIOKafkaConsumer(TOPICS.policy.name, bootstrap_servers=bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=poll_ms)
            records = []
            for messages in batches.values():
                for message in messages:
                    try:
                        records.append(decode(message.value)[1])
                    except DecodeError as exc:
                        log.warning("skipping an undecodable forge.policy record at offset %s: %s",
                                    message.offset, exc)
            target = newest(records, engine.policy_version)
            if target is not None:
                result = await engine.load_weights(target["checkpoint_uri"], target["version"])
                log.info("loaded policy version %s from %s in %.2fs", result.policy_version, result.path,
                         result.load_seconds)
    finally:
        await consumer.stop()

