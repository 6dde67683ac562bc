"""What other gateway replicas record for the sessions this one holds, followed as it happens (shared sessions).

Each replica tails forge.completions and forge.sessions from where they ended when it started (a consumer in a
thread, outside any consumer group), reading only the leading fields of each record (`forge_stream.events.peek`:
session and request ids, microseconds, where decoding a Completion takes about a millisecond). It keeps, per session,
the offset of the last Completion another replica recorded (its request id is not one this replica recorded) and
whether a SessionFinished was seen.

A call of a held session must see everything acknowledged before it arrived: `caught_up` asks Kafka for the end
offsets of both topics (one lookup serves every call that arrived before it was sent) and waits until the tail has
read up to them. Acknowledged means acks=all, below the high watermark, so the lookup's offsets cover every record
another replica answered its caller for. Then the held session is stale exactly when another replica recorded for
it past what this one last read of it (`SessionRestorer` rebuilds it), and finished when a SessionFinished was seen.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections import OrderedDict

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from forge_stream.events import DecodeError, peek
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)
_TOPICS = (TOPICS.completions, TOPICS.sessions)
_MOVING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)


def _bounded_set(entries: OrderedDict, key: str, value, limit: int) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > limit:
        entries.popitem(last=False)


async def _all_done(futures: list[concurrent.futures.Future]) -> None:
    """Wait for Kafka's futures (one per partition), waking the event loop once rather than once for each."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    left, lock = [len(futures)], threading.Lock()

    def one_done(_) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

    for future in futures:
        future.add_done_callback(one_done)
    await done


class SessionLog:
    """The tail of forge.completions and forge.sessions as seen by one replica. `keep` bounds each of its maps
    (sessions it knows of, request ids it recorded lately), the oldest forgotten first."""

    def __init__(self, bootstrap: str, timeout_s: float, keep: int):
        self.timeout_s, self.keep = timeout_s, keep
        self.foreign: OrderedDict[str, int] = OrderedDict()  # session id -> offset of another replica's Completion
        self.finished: OrderedDict[str, None] = OrderedDict()  # sessions a SessionFinished was read for
        self._own: OrderedDict[str, None] = OrderedDict()  # request ids this replica is recording or recorded
        self._admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        # a fetch at the end waits at the broker until a record arrives (or fetch.wait.max.ms): no need to ask often
        self._consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "forge-gateway-log",
                                   "enable.auto.commit": False, "enable.partition.eof": False, "log_level": 0})
        self._tps: list[TopicPartition] = []
        self._positions: dict[tuple[str, int], int] = {}  # read up to here (next offset), by (topic, partition)
        self._waiters: list[tuple[dict[tuple[str, int], int], asyncio.Future]] = []
        self._next: asyncio.Future | None = None  # the end-offsets lookup the next calls share
        self._looking = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _partitions(self) -> list[TopicPartition]:
        found = self._consumer.list_topics(timeout=self.timeout_s).topics
        out = []
        for topic in _TOPICS:
            meta = found.get(topic.name)
            if meta is None or meta.error is not None:
                raise KafkaException(meta.error if meta is not None else f"{topic.name} does not exist")
            out += [TopicPartition(topic.name, p) for p in sorted(meta.partitions)]
        return out

    async def _ends(self) -> dict[tuple[str, int], int]:
        """The end offsets (high watermarks) of both topics' partitions, asked now (again while Kafka answers with
        a retriable error, such as a leader moving)."""
        while True:
            futures = self._admin.list_offsets({tp: OffsetSpec.latest() for tp in self._tps},
                                               request_timeout=self.timeout_s)
            await _all_done(list(futures.values()))
            try:
                return {(tp.topic, tp.partition): f.result().offset for tp, f in futures.items()}
            except KafkaException as exc:  # librdkafka does not flag a moving leader retriable here
                if not (exc.args[0].retriable() or exc.args[0].code() in _MOVING):
                    raise
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        """Start tailing from the current ends."""
        self._loop = asyncio.get_running_loop()
        self._tps = await asyncio.to_thread(self._partitions)
        self._positions = await asyncio.wait_for(self._ends(), self.timeout_s)
        self._consumer.assign([TopicPartition(t, p, offset) for (t, p), offset in self._positions.items()])
        self._thread = threading.Thread(target=self._tail, name="forge-session-log", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._consumer.close()

    def recording(self, request_id: str) -> None:
        """This replica is about to record `request_id`'s Completions: the tail does not count them as foreign."""
        _bounded_set(self._own, request_id, None, self.keep)

    def not_recorded(self, request_id: str) -> None:
        """Kafka did not acknowledge them: should they land after all, they count as another replica's."""
        self._own.pop(request_id, None)

    def _tail(self) -> None:
        completions, sessions = TOPICS.completions.name, TOPICS.sessions.name
        while not self._stop.is_set():
            try:
                first = self._consumer.poll(0.1)  # as soon as there is one (consume waits for all it asks for)
                messages = [] if first is None else [first, *self._consumer.consume(1000, 0)]
                positions = self._consumer.position(list(self._consumer.assignment()))
            except KafkaException as exc:
                log.warning("session log: %s", exc)
                continue
            for msg in messages:
                if msg.error() is not None:
                    continue
                try:
                    if msg.topic() == completions:
                        _, ids = peek(msg.value(), ("session_id", "request_id"))
                        if ids["request_id"] not in self._own:
                            _bounded_set(self.foreign, ids["session_id"], msg.offset(), self.keep)
                    elif msg.topic() == sessions:
                        schema, ids = peek(msg.value(), ("session_id",))
                        if schema == "SessionFinished":
                            _bounded_set(self.finished, ids["session_id"], None, self.keep)
                except DecodeError:
                    continue  # not an event: the processors send it to the DLQ
            moved = {(tp.topic, tp.partition): tp.offset for tp in positions if tp.offset >= 0}
            if any(self._positions.get(key, -1) < offset for key, offset in moved.items()):
                self._loop.call_soon_threadsafe(self._advance, moved)

    def _advance(self, moved: dict[tuple[str, int], int]) -> None:
        for key, offset in moved.items():
            self._positions[key] = max(self._positions.get(key, 0), offset)
        waiting = []
        for target, future in self._waiters:
            if future.done():
                continue
            if all(self._positions.get(key, 0) >= offset for key, offset in target.items()):
                future.set_result(None)
            else:
                waiting.append((target, future))
        self._waiters = waiting

    async def _lookup(self) -> dict[tuple[str, int], int]:
        """End offsets from a lookup sent after this call: the one about to go, shared with later arrivals."""
        future = self._next
        if future is None:
            future = self._next = asyncio.get_running_loop().create_future()
            if not self._looking:
                self._send_lookup()
        return await asyncio.shield(future)

    def _send_lookup(self) -> None:
        future, self._next, self._looking = self._next, None, True

        def settle(task: asyncio.Task) -> None:
            self._looking = False
            if task.cancelled():
                future.cancel()
            elif task.exception() is not None:
                future.set_exception(task.exception())
            else:
                future.set_result(task.result())
            if self._next is not None:
                self._send_lookup()

        asyncio.ensure_future(self._ends()).add_done_callback(settle)

    async def caught_up(self, partitions: dict[str, int]) -> None:
        """Wait until the tail has read everything acknowledged before this call in `partitions` (topic name ->
        partition: those a session's group id is keyed to); TimeoutError past the Kafka timeout."""
        async with asyncio.timeout(self.timeout_s):
            ends = await self._lookup()
            target = {key: ends[key] for key in partitions.items()}
            if all(self._positions.get(key, 0) >= offset for key, offset in target.items()):
                return
            future = asyncio.get_running_loop().create_future()
            self._waiters.append((target, future))
            await future
