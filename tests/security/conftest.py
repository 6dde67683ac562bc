"""Fixtures of the security suite: the attacker is another process on the gateway's host, with no token, a wrong
one, or an agent's own session token, talking real HTTP to real servers (a gateway in front of a scripted engine
and the real Kafka broker; torch engine processes)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import serving
from security_support import ADMIN

from forge_stream.gateway.app import create_app
from forge_stream.bench.scripted import ScriptedEngine
from forge_stream.gateway.settings import GatewaySettings


@pytest.fixture(scope="module")
def secured_gateway(kafka_bootstrap) -> Iterator[str]:
    """A gateway with an admin token in front of a scripted engine."""
    with serving(ScriptedEngine(("Hello there, agent.",))) as engine, \
            serving(create_app(GatewaySettings(engines=(engine,), bootstrap=kafka_bootstrap, admin_token=ADMIN,
                                               max_request_bytes=64 * 1024))) as url:
        yield url

