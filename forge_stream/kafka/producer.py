"""The event producer: Avro-encodes catalog events and sends them with acks=all and idempotence, to the partition
Kafka's Java client would pick for their key (librdkafka's `murmur2_random`: forge_stream.kafka.partitioner).

`send` returns an asyncio future that resolves only once Kafka acknowledged the record, so a server can answer
its caller after the event is durable and never before. `send_sync` is the same for scripts. The acknowledgements
that one poll of librdkafka serves reach each event loop in one hand-over (one wake-up of the loop, not one per
record: a `call_soon_threadsafe` per record costs a self-pipe write and a loop wake-up for every event).
A patient producer (`patient=True`: the trainer, the rollout controller) never gives a record up: while Kafka is
away its sends wait, and go through once it is back, instead of failing after `message.timeout.ms`.
A record larger than its topic takes (`Topic.max_message_bytes`, less `RECORD_OVERHEAD` for the batch framing) is
refused before it is sent: KafkaException with MSG_SIZE_TOO_LARGE, as librdkafka raises past `message.max.bytes`
(which is sized to the catalog's largest topic limit).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from confluent_kafka import KafkaError, KafkaException, Producer

from forge_stream.events import encode
from forge_stream.kafka.clientlog import CLIENT_LOG
from forge_stream.topics import TOPICS, Topic

RECORD_OVERHEAD = 1024  # record batch and record headers around a value and key (the broker counts them)


class DeliveryError(RuntimeError):
    """Kafka did not acknowledge a record (broker down, timeout, fenced...)."""


def producer_config(bootstrap: str, **overrides) -> dict:
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": "murmur2_random",  # keyed: murmur2 as Java's and aiokafka's default (not librdkafka's CRC32)
        "linger.ms": 2,
        "compression.type": "lz4",
        "message.timeout.ms": 15000,
        "message.max.bytes": TOPICS.largest_message_bytes() + RECORD_OVERHEAD,
        **overrides,
    }


class EventProducer:
    """One idempotent producer per process; a background thread serves delivery callbacks."""

    def __init__(self, bootstrap: str, patient: bool = False, **config):
        self.patient = patient
        if patient:
            config["message.timeout.ms"] = 0  # librdkafka: retry (idempotently) until acknowledged
        # its log through Python logging (forge_stream.kafka.clientlog): the poll thread below serves it
        self._producer = Producer(producer_config(bootstrap, **{"logger": CLIENT_LOG, **config}))
        # acknowledgements not yet handed to their loops (appended by librdkafka's callbacks on whichever thread
        # polls or flushes; a deque, whose append and popleft are atomic across threads)
        self._acked: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future, KafkaError | None, object]] = deque()
        self._stop = threading.Event()
        self._poller = threading.Thread(target=_serve, args=(weakref.ref(self), self._stop),
                                        name="forge-producer-poll", daemon=True)
        self._poller.start()

    def _hand_over(self) -> None:
        """Settle the futures of the acknowledgements served since the last call, one loop wake-up per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        while self._acked:
            loop, future, err, msg = self._acked.popleft()
            by_loop.setdefault(loop, []).append((future, err, msg))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, settled)
            except RuntimeError:  # that loop was closed: nobody waits for these futures any more
                pass

    def produce(self, topic: Topic, key: str, record: dict, schema: str | None = None, on_delivery=None) -> None:
        """Encode and enqueue; `on_delivery(err, msg)` runs on the poll thread."""
        schema = schema or topic.value_schemas[0]
        if schema not in topic.value_schemas:
            raise ValueError(f"{topic.name} carries {topic.value_schemas}, not {schema}")
        value, key_bytes = encode(schema, record), key.encode()
        size = len(value) + len(key_bytes) + RECORD_OVERHEAD
        if size > topic.max_message_bytes:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, (
                f"a {schema} of {size} bytes is larger than {topic.name} takes "
                f"(max.message.bytes {topic.max_message_bytes})")))
        self._producer.produce(topic.name, value=value, key=key_bytes, on_delivery=on_delivery)

    def produce_raw(self, topic: str, key: bytes | None, value: bytes, on_delivery=None) -> None:
        self._producer.produce(topic, value=value, key=key, on_delivery=on_delivery)

    def send(self, topic: Topic, key: str, record: dict, schema: str | None = None) -> asyncio.Future:
        """Enqueue and return a future (of the running loop) resolved with the offset once acked."""
        future, on_delivery = self._awaited()
        self.produce(topic, key, record, schema, on_delivery=on_delivery)
        return future

    def send_raw(self, topic: str, key: bytes | None, value: bytes) -> asyncio.Future:
        """`send` for bytes already encoded (or not an event: `bench gateway --floor` writes to a scratch topic)."""
        future, on_delivery = self._awaited()
        self.produce_raw(topic, key, value, on_delivery)
        return future

    def _awaited(self) -> tuple[asyncio.Future, object]:
        """A future of the running loop, and the delivery callback that hands its acknowledgement over."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        return future, lambda err, msg: self._acked.append((loop, future, err, msg))

    def send_sync(self, topic: Topic, key: str, record: dict, schema: str | None = None,
                  timeout: float = 30.0) -> int:
        """Send one record and block until Kafka acknowledged it (a patient producer: however long that takes);
        returns its offset."""
        result: dict = {}
        acked = threading.Event()

        def done(err, msg):
            result["err"], result["msg"] = err, msg
            acked.set()

        self.produce(topic, key, record, schema, on_delivery=done)
        if not acked.wait(None if self.patient else timeout):
            raise DeliveryError(f"no acknowledgement from Kafka for {topic.name} within {timeout:.0f}s")
        if result["err"] is not None:
            raise DeliveryError(f"Kafka rejected a record for {topic.name}: {result['err']}")
        return result["msg"].offset()

    def flush(self, timeout: float = 30.0) -> None:
        remaining = self._producer.flush(timeout)
        if remaining:
            raise DeliveryError(f"{remaining} records were still unacknowledged after {timeout:.0f}s")

    def close(self, timeout: float = 30.0) -> None:
        """Flush (DeliveryError if records stay unacknowledged after `timeout` s), then release the client: its
        threads and broker connections end here, not whenever the garbage collector gets to it. Closing twice does
        nothing."""
        if self._stop.is_set():
            return
        try:
            self.flush(timeout)
        finally:
            self._stop.set()
            self._poller.join()
            self._producer.purge()  # what the flush left (Kafka away) is dropped, not waited for by close()
            self._producer.close()


def _serve(ref: weakref.ref[EventProducer], stop: threading.Event) -> None:
    """The poll thread. It holds its producer only while it polls, so a producer nobody closed is freed, with its
    client's threads and broker connections, once nothing else refers to it (not kept for the process's life)."""
    while not stop.is_set():
        producer = ref()
        if producer is None:
            return
        producer._producer.poll(0.05)
        producer._hand_over()
        del producer
    producer = ref()
    if producer is not None:
        producer._hand_over()  # what a last flush served


def _settle_all(settled: list[tuple[asyncio.Future, KafkaError | None, object]]) -> None:
    for future, err, msg in settled:
        if future.done():
            continue
        if err is not None:
            future.set_exception(DeliveryError(f"Kafka rejected the record: {err}"))
        else:
            future.set_result(msg.offset())


__all__ = ["DeliveryError", "EventProducer", "KafkaException", "producer_config"]
