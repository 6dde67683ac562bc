"""Follow one topic from its beginning without a consumer group, in an asyncio service (aiokafka): how every
engine replica, torch or vLLM, reads forge.policy (forge_stream.engine.shared.follower), so that each of them sees every
record.

`Follower` starts once Kafka answers, retrying while it does not (the caller serves on meanwhile). It hands over
the decoded records carrying one key (the training run), poll by poll (`next`), or the whole history up to the end
offsets the partitions have now as one batch (`backlog`). An undecodable record is logged and passed over. While
Kafka is away polls come back empty, and aiokafka reconnects. `caught_up` hands over everything from the current
position to the end offsets of now (what arrived while the caller was busy).
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError

from forge_stream.events import DecodeError, decode
from forge_stream.topics import Topic

log = logging.getLogger(__name__)


class Follower:
    """`async with Follower(bootstrap, topic, key) as f:` then `await f.backlog()` and/or `await f.next()`."""

    def __init__(self, bootstrap: str, topic: Topic, key: str, poll_ms: int = 500, retry_s: float = 2.0):
        self.bootstrap, self.topic, self.key = bootstrap, topic, key.encode()
        self.poll_ms, self.retry_s = poll_ms, retry_s
        self._consumer: AIOKafkaConsumer | None = None

    async def __aenter__(self) -> "Follower":
        while True:  # Kafka away at start: try again
            consumer = AIOKafkaConsumer(self.topic.name, bootstrap_servers=self.bootstrap, group_id=None,
                                        auto_offset_reset="earliest", enable_auto_commit=False)
            try:
                await consumer.start()
            except KafkaError as exc:
                log.warning("cannot reach Kafka at %s to follow %s (%s); retrying", self.bootstrap, self.topic.name,
                            exc)
                await consumer.stop()
                await asyncio.sleep(self.retry_s)
                continue
            except BaseException:  # e.g. an address aiokafka cannot parse: the caller's to report
                await consumer.stop()
                raise
            self._consumer = consumer
            return self

    async def __aexit__(self, *exc) -> None:
        await self._consumer.stop()

    async def next(self) -> list[dict]:
        """The records with the key among those one poll (up to `poll_ms`) brings."""
        batches = await self._consumer.getmany(timeout_ms=self.poll_ms)
        records = []
        for messages in batches.values():
            for message in messages:
                if message.key != self.key:
                    continue
                try:
                    records.append(decode(message.value)[1])
                except DecodeError as exc:
                    log.warning("skipping an undecodable %s record at offset %s: %s", self.topic.name,
                                message.offset, exc)
        return records

    async def backlog(self) -> list[dict]:
        """The records with the key from the beginning up to the end offsets the partitions have now."""
        consumer = self._consumer
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=50)
        await consumer.seek_to_beginning()
        return await self.caught_up()

    async def caught_up(self) -> list[dict]:
        """The records with the key from where this follower is up to the end offsets the partitions have now: all
        that came while the caller was busy, however many polls that takes (one `next` may bring only part)."""
        consumer = self._consumer
        ends = await consumer.end_offsets(list(consumer.assignment()))
        records = []
        while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
            records += await self.next()
        return records
