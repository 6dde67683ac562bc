"""An EventProducer's client (librdkafka threads, broker connections) ends with it: at close(), or when nothing
refers to a producer nobody closed (its poll thread does not keep it alive for the rest of the process)."""

import gc
import threading
import time
import weakref

import pytest

from helpers import until

from forge_stream.kafka.producer import DeliveryError, EventProducer
from forge_stream.topics import TOPICS


def poll_threads() -> int:
    return sum(t.name == "forge-producer-poll" for t in threading.enumerate())


def test_an_unclosed_producer_is_freed_once_unreferenced(kafka_bootstrap):
    before = poll_threads()
    producer = EventProducer(kafka_bootstrap)
    assert producer._producer.list_topics(timeout=30).brokers  # connected
    assert poll_threads() == before + 1
    ref = weakref.ref(producer)
    del producer
    gc.collect()
    assert until(lambda: ref() is None and poll_threads() == before, 10), "the producer outlived its last reference"


def test_close_releases_the_client_and_twice_is_harmless(kafka_bootstrap):
    producer = EventProducer(kafka_bootstrap)
    producer.close()
    producer.close()
    with pytest.raises(RuntimeError):  # confluent-kafka refuses a closed producer
        producer.produce_raw(TOPICS.dlq.name, None, b"x")


def test_close_with_kafka_away_reports_what_was_not_acknowledged_and_returns():
    producer = EventProducer("127.0.0.1:1", patient=True)  # nothing listens: records wait for ever
    producer.produce_raw(TOPICS.dlq.name, None, b"x")
    started = time.monotonic()
    with pytest.raises(DeliveryError, match="1 records were still unacknowledged after 1s"):
        producer.close(timeout=1.0)
    assert time.monotonic() - started < 20  # the flush's timeout, not for ever
