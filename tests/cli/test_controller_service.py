"""The controller as a service of a topology (topologies/learn.yaml)."""

import shlex
import sys

import pytest

from forge_stream.builders import BUILDERS
from forge_stream.deploy import load_topology
from forge_stream.settings import ForgeSettings
from forge_stream.shipped import shipped


def test_learn_topology_runs_a_looping_pooled_controller_after_the_gateway():
    topology = load_topology("learn")
    assert topology.services == ["registry", "engine", "gateway", "processors", "trainer", "controller"]
    settings = ForgeSettings(bootstrap_servers="127.0.0.1:1234", gateway_port=8123)
    spec = BUILDERS["controller"](settings, topology.options["controller"])
    argv = spec.argv
    assert argv[:5] == [sys.executable, "-m", "forge_stream", "rollout", "run"]
    option = {argv[i]: argv[i + 1] for i in range(5, len(argv) - 1) if argv[i].startswith("--")}
    assert option["--tasks"] == "suite:train"
    assert shlex.split(option["--agent"]) == [sys.executable, str(shipped("examples/agents/tool_agent.py")),
                                              "--serve"]
    assert option["--gateway-url"] == "http://127.0.0.1:8123"
    assert option["--bootstrap-servers"] == "127.0.0.1:1234"
    assert option["--agent-workers"] == "2" and option["--concurrency"] == "64" and option["--group-size"] == "8"
    assert "--loop" in argv


def test_controller_needs_an_agent_and_is_not_in_the_default_topology():
    assert "controller" not in load_topology("local").services
    with pytest.raises(ValueError, match="agent"):
        BUILDERS["controller"](ForgeSettings(), {})

