"""Fixtures of the gateway tests: real servers on free ports (a scripted engine, gateways).

Servers run in background threads of the test process with uvicorn, so clients talk real HTTP to them; the
engine-process and fake-vLLM fixtures of the integration tests live in their own test modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from helpers import serving

from forge_stream.gateway.app import create_app
from forge_stream.gateway.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings


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
