"""librdkafka's log lines through Python logging, for the Kafka clients that poll all the time.

Left alone, a librdkafka client writes its log to stderr in its own form, `%4|1796248591.927|GETPID|rdkafka#producer-4|
[thrd:main]: Failed to acquire idempotence PID from broker ...: Coordinator load in progress: retrying`: a syslog level
number and a Unix time, in a service log whose other lines have a date and a level name. `CLIENT_LOG`, passed as a
client's `logger` setting, sends each line to the `librdkafka` logger instead, so it reads like the service's own
(`2026-12-02 21:56:31,927 INFO librdkafka: GETPID rdkafka#producer-4 [thrd:main]: ...`).

A warning that only says librdkafka is retrying by itself (the line ends in "retrying": a fresh broker still loading
its transaction coordinator when the first idempotent producer asks it for a producer id) is logged at INFO: it is
expected after every fresh start and needs nothing from the user; if the retries never succeed, the records they
hold fail with an error of their own (the gateway's 503, the trainer waiting for Kafka). Errors stay errors.

librdkafka hands its lines to Python from the client's poll (the setting moves them onto the client's main queue), so
only a client that polls all the time may take it: the EventProducer (its poll thread) and the DecodingConsumer. A
short-lived client (an admin call, a one-off offsets read) keeps librdkafka's own stderr log, which needs no poll.
"""

from __future__ import annotations

import logging

LOGGER = logging.getLogger("librdkafka")


class ClientLog:
    """A Kafka client's `logger`: confluent-kafka calls `log(level, "%s [%s] %s", facility, client, text)` with
    librdkafka's level already a Python one."""

    def log(self, level: int, msg: str, *args) -> None:
        if len(args) != 3:  # not the call above: log it as it came
            LOGGER.log(level, msg, *args)
            return
        facility, client, text = args
        if level == logging.WARNING and text.rstrip().endswith("retrying"):
            level = logging.INFO
        LOGGER.log(level, "%s %s %s", facility, client, text)


CLIENT_LOG = ClientLog()
