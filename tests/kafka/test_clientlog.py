"""librdkafka's log through Python logging (forge_stream.kafka.clientlog): a real client's lines reach the
`librdkafka` logger from its poll, errors as errors, a warning that only says librdkafka retries as INFO."""

import logging
import socket
import time

from forge_stream.kafka.clientlog import CLIENT_LOG
from forge_stream.kafka.producer import EventProducer


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_real_producers_log_reaches_python_logging_through_its_poll_thread(caplog):
    caplog.set_level(logging.DEBUG, logger="librdkafka")
    producer = EventProducer(f"127.0.0.1:{_closed_port()}")  # nothing listens: librdkafka logs its failed connects
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any(r.name == "librdkafka" for r in caplog.records):
            time.sleep(0.1)
    finally:
        producer.close(timeout=0)
    lines = [r for r in caplog.records if r.name == "librdkafka"]
    assert lines, "no librdkafka line reached the librdkafka logger within 20 s"
    refused = [r for r in lines if "Connection refused" in r.getMessage()]
    assert refused and all(r.levelno == logging.ERROR for r in refused), [(r.levelname, r.getMessage()) for r in lines]
    assert refused[0].getMessage().startswith("FAIL rdkafka#producer-"), refused[0].getMessage()


def test_retrying_warnings_are_info_and_the_rest_keep_their_level(caplog):
    caplog.set_level(logging.DEBUG, logger="librdkafka")
    retry = ("[thrd:main]: Failed to acquire idempotence PID from broker 127.0.0.1:9092/1: "
             "Broker: Coordinator load in progress: retrying")
    CLIENT_LOG.log(logging.WARNING, "%s [%s] %s", "GETPID", "rdkafka#producer-4", retry)
    CLIENT_LOG.log(logging.WARNING, "%s [%s] %s", "TERMINATE", "rdkafka#producer-4", "[thrd:main]: still waiting")
    CLIENT_LOG.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-4", "[thrd:x]: refused: retrying")
    CLIENT_LOG.log(logging.WARNING, "an unexpected %s", "form")
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "librdkafka"]
    assert got == [
        (logging.INFO, f"GETPID rdkafka#producer-4 {retry}"),
        (logging.WARNING, "TERMINATE rdkafka#producer-4 [thrd:main]: still waiting"),
        (logging.ERROR, "FAIL rdkafka#producer-4 [thrd:x]: refused: retrying"),
        (logging.WARNING, "an unexpected form"),
    ]
