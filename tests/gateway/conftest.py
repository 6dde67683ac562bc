"""Fixtures of the gateway tests: real servers on free ports (a scripted engine, gateways).

Servers run in background threads of the test process with uvicorn, so clients talk real HTTP to them; the
engine-process and fake-vLLM fixtures of the integration tests live in their own test modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from helpers import serving

from forge_stream.gateway.app import create_app
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.schema_registry import create_app as create_registry


@pytest.fixture(scope="session")
def scripted_url() -> Iterator[str]:
    """A scripted engine: answers a tool call to requests with tools (unless answering a tool result), else text."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "paris"}}</tool_call>'
    engine = ScriptedEngine(("Hello there, agent.",), policy_version=7, tool_call=call)
    with serving(engine, http="auto") as url:  # uvicorn's own protocol, as vLLM's server runs it
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


@pytest.fixture(scope="session")
def registry_url() -> Iterator[str]:
    """The schema registry API (Confluent's), as outside consumers of the topics use it."""
    with serving(create_registry()) as url:
        yield url


@pytest.fixture
def scripted_gateway(kafka_bootstrap) -> Callable:
    """Start a scripted engine of its own (replies, tool calls cycling) and a gateway in front of it; yields the
    gateway's URL. An engine per test, since a script's position is shared by all its callers."""

    @contextmanager
    def start(replies: tuple[str, ...], tool_call: str | tuple[str, ...] | None = None) -> Iterator[str]:
        with serving(ScriptedEngine(replies, tool_call=tool_call)) as engine, \
                serving(create_app(GatewaySettings(engines=(engine,), bootstrap=kafka_bootstrap))) as url:
            yield url

    return start
