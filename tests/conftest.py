"""Shared fixtures. The one Kafka broker of a test session is a real Apache Kafka 4.x (KRaft, single node).

If FORGE_TEST_BOOTSTRAP_SERVERS is set (CI starts a broker with `forge-stream up` and sets it), the tests use
that cluster; otherwise the session fixture starts its own broker from the Maven-fetched jars on random free
ports with its own data directory, so a bare `pytest` works too.

As the session begins, the engine servers its selected tests use start in the background (tests/early.py).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge_stream.tiny.model import TinyModelSpec, init_tiny_model
from forge_stream.kafka.admin import create_topics
from forge_stream.kafka.broker import BrokerConfig, LocalBroker, free_port
from forge_stream.settings import ForgeSettings

import helpers
from early import EARLY


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    """Bootstrap servers of a running broker with every catalog topic created."""
    external = os.environ.get("FORGE_TEST_BOOTSTRAP_SERVERS")
    if external:
        create_topics(external)
        yield external
        return
    broker = LocalBroker(BrokerConfig(tmp_path_factory.mktemp("kafka"), ForgeSettings().cache_dir,
                                      port=free_port(), controller_port=free_port()))
    bootstrap = broker.start()
    create_topics(bootstrap)
    yield bootstrap
    broker.stop()


@pytest.fixture(scope="session", autouse=True)
def early_starts(request):
    """Start in the background what the selected tests declared (tests/early.py); stop what none of them took."""
    EARLY.begin(request.session.items, request.getfixturevalue)
    yield
    EARLY.end()


@pytest.fixture(autouse=True)
def _test_started(request):
    """When this test began (helpers.since_this_test), taken before its other function-scoped fixtures run; and
    where the session is, for the starts of tests/early.py."""
    helpers.TEST_STARTED_MS[0] = int(time.time() * 1000) - 1000
    EARLY.reached(request.node.nodeid)


@pytest.fixture
def run_id() -> str:
    """A unique id for this test's groups, sessions and consumer groups on the shared broker."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "model"
    init_tiny_model(out, TinyModelSpec(seed=0))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir_v1(tmp_path_factory) -> Path:
    """Same tokenizer and shapes, other weights: stands in for the next policy version."""
    out = tmp_path_factory.mktemp("tiny_v1") / "model"
    init_tiny_model(out, TinyModelSpec(seed=0))
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(out)
    return out
