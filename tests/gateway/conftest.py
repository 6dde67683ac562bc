"""Fixtures of the gateway tests: real servers on free ports (scripted engine, gateway) and a Kafka reader.

Servers run in background threads of the test process with uvicorn, so clients talk real HTTP to them; the
engine-process and fake-vLLM fixtures of the integration tests live in their own test modules.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest
import uvicorn
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from forge_stream.events import decode
from forge_stream.gateway.app import create_app
from forge_stream.gateway.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.kafka.broker import free_port
from forge_stream.topics import Topic

ADMIN = "admin-secret"


@contextmanager
def serving(app) -> Iterator[str]:
    """Serve an ASGI app on a free port in a thread; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="session")
def scripted_url() -> Iterator[str]:
    """A scripted engine: answers a tool call to requests with tools (unless answering a tool result), else text."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
    with serving(ScriptedEngine(("Hello there, agent.",), policy_version=7, tool_call=call)) as url:
        yield url


@pytest.fixture(scope="session")
def gateway_url(kafka_bootstrap, scripted_url) -> Iterator[str]:
    """A gateway without auth in front of the scripted engine."""
    with serving(create_app(GatewaySettings(engines=(scripted_url,), bootstrap=kafka_bootstrap))) as url:
        yield url


@pytest.fixture
def make_gateway(kafka_bootstrap) -> Callable:
    """Start a gateway with given settings (engines default to none reachable); yields its URL."""
    return lambda **kw: serving(create_app(GatewaySettings(**{"bootstrap": kafka_bootstrap, **kw})))


def open_session(gateway: str, group_id: str, task_id: str = "task", token: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": task_id, **extra},
                          headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def read_events(bootstrap: str, topic: Topic, where: Callable[[dict], bool], timeout: float = 30.0) -> list[dict]:
    """Every record of `topic` matching `where`, read from the beginning up to the current end of each partition
    (events the gateway acknowledged are all below it). No consumer group is used."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "gateway-tests", "enable.auto.commit": False})
    ends = {}
    for p in range(topic.partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic.name, p), timeout=10)
        if high > low:
            ends[p] = high
    consumer.assign([TopicPartition(topic.name, p, OFFSET_BEGINNING) for p in ends])
    found: list[dict] = []
    deadline = time.monotonic() + timeout
    try:
        while ends and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error():
                continue
            if message.offset() >= ends.get(message.partition(), -1):
                continue
            _, record = decode(message.value())
            if where(record):
                found.append(record)
            if message.offset() == ends[message.partition()] - 1:
                del ends[message.partition()]
    finally:
        consumer.close()
    assert not ends, f"could not read {topic.name} to its end within {timeout}s"
    return found
