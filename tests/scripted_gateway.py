"""Fixtures of the rollout and eval tests: a scripted engine and a gateway in front of it, real servers on free
ports (conftest.py files of those suites import them).

The engine answers a `calculator` tool call ("6*7") to requests with tools (unless answering a tool result) and
"The answer is 42." otherwise, with policy version 3; the gateway records on the test session's broker.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import serving

from forge_stream.gateway.app import create_app
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
POLICY_VERSION = 3


@pytest.fixture(scope="session")
def engine_url() -> Iterator[str]:
    with serving(ScriptedEngine(("The answer is 42.",), policy_version=POLICY_VERSION, tool_call=CALL)) as url:
        yield url


@pytest.fixture(scope="session")
def gateway(kafka_bootstrap, engine_url) -> Iterator[str]:
    with serving(create_app(GatewaySettings(engines=(engine_url,), bootstrap=kafka_bootstrap))) as url:
        yield url
