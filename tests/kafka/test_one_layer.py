"""One Kafka layer, one process helper: the package's modules outside forge_stream/kafka build no Kafka client and
commit no offsets of their own, nothing outside forge_stream/proc.py spawns a process with Popen, and no test fake
lives in the package (the scripted engine aside: the benchmarks run it).

Faust keeps its own clients (topologies/ only imports faust). Error types (KafkaException, KafkaError...) may be
imported anywhere: catching an error builds no client.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("forge_stream", "connectors", "topologies")
KAFKA_LAYER = "forge_stream/kafka/"
PROCESS_HELPER = "forge_stream/proc.py"
CLIENT_MODULES = ("confluent_kafka", "aiokafka", "kafka")
CLIENTS = {"Consumer", "Producer", "AdminClient", "DeserializingConsumer", "SerializingProducer",
           "AIOKafkaConsumer", "AIOKafkaProducer", "AIOKafkaAdminClient", "KafkaConsumer", "KafkaProducer"}
# package modules that may hold a fake, and why
FAKES_ALLOWED = {"forge_stream/bench/scripted.py": "the scripted engine the benchmarks (and tests) run"}
FAKE_NAME = re.compile(r"(^|_)(fake|stub|dummy|mock)", re.IGNORECASE)


def _client_module(name: str | None) -> bool:
    return name is not None and name.split(".")[0] in CLIENT_MODULES


def problems(path: str, source: str) -> list[str]:
    """What breaks the rules in one module (`path` relative to the repository)."""
    found = []
    in_layer = path.startswith(KAFKA_LAYER)
    for node in ast.walk(ast.parse(source)):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if not in_layer and isinstance(node, ast.ImportFrom) and _client_module(node.module):
            for alias in node.names:
                if alias.name in CLIENTS or alias.name == "*":
                    found.append(f"{where}: imports {node.module}.{alias.name} (use forge_stream.kafka)")
        elif not in_layer and isinstance(node, ast.Import):
            for alias in node.names:
                if _client_module(alias.name):
                    found.append(f"{where}: imports {alias.name} whole (import its error types by name)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if not in_layer and func.attr == "commit" and (node.args or node.keywords):
                found.append(f"{where}: commits offsets itself (commit through forge_stream.kafka's Watermarks)")
            if func.attr == "Popen" and path != PROCESS_HELPER:
                found.append(f"{where}: spawns with Popen (use forge_stream.proc)")
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess" and path != PROCESS_HELPER:
            if any(alias.name == "Popen" for alias in node.names):
                found.append(f"{where}: imports subprocess.Popen (use forge_stream.proc)")
        if (isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and FAKE_NAME.search(node.name)
                and path not in FAKES_ALLOWED):
            found.append(f"{where}: {node.name} looks like a test fake (fakes live under tests/)")
    return found


def _modules() -> list[Path]:
    return sorted(p for folder in SCANNED for p in (REPO / folder).rglob("*.py"))


def test_the_package_goes_through_one_kafka_layer_and_one_process_helper():
    modules = _modules()
    assert len(modules) > 100 and (REPO / PROCESS_HELPER) in modules
    found = [p for path in modules for p in problems(path.relative_to(REPO).as_posix(), path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path, source, rule", [
    ("forge_stream/gateway/x.py", "from confluent_kafka import OFFSET_END, Consumer", "confluent_kafka.Consumer"),
    ("connectors/x.py", "from confluent_kafka.admin import AdminClient", "AdminClient"),
    ("forge_stream/engine/x.py", "from aiokafka import AIOKafkaConsumer", "AIOKafkaConsumer"),
    ("topologies/x.py", "import confluent_kafka", "whole"),
    ("connectors/x.py", "consumer.commit(offsets=offsets, asynchronous=False)", "commits offsets itself"),
    ("forge_stream/x.py", "self.consumer.commit(due)", "commits offsets itself"),
    ("forge_stream/bench/x.py", "import subprocess\nsubprocess.Popen(['true'])", "Popen"),
    ("forge_stream/kafka/x.py", "from subprocess import Popen", "Popen"),
    ("forge_stream/engine/x.py", "class FakeEngine:\n    pass", "test fake"),
])
def test_each_rule_finds_what_breaks_it(path, source, rule):
    found = problems(path, source)
    assert len(found) == 1 and rule in found[0], found


@pytest.mark.parametrize("path, source", [
    ("forge_stream/gateway/x.py", "from confluent_kafka import KafkaError, KafkaException"),
    ("forge_stream/kafka/x.py", "from confluent_kafka import Consumer\nc.commit(offsets=o, asynchronous=False)"),
    ("connectors/x.py", "self.consumer.commit()"),
    ("forge_stream/proc.py", "subprocess.Popen(argv)"),
    ("forge_stream/bench/scripted.py", "def fake_usage():\n    pass"),
])
def test_what_the_rules_allow(path, source):
    assert problems(path, source) == []
