"""Safe by default: a service that would listen beyond loopback without credentials refuses to start; `up`
generates the credentials (0600) and hands each service only the tokens it uses, never printing them; an agent
gets its session's token and none of the controller's."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys

import httpx
import pytest

from forge_stream import credentials
from forge_stream.credentials import ENGINE_ENV, GATEWAY_ENV
from forge_stream.deploy import describe_plan, load_topology, plan
from forge_stream.kafka.broker import free_port
from forge_stream.proc import start_process, stop, wait_healthy
from forge_stream.rollout.agents import AgentContext, CommandAgent
from forge_stream.rollout.pool import PooledCommandAgent
from forge_stream.services import Supervisor
from forge_stream.settings import ForgeSettings


def _clean_env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k not in credentials.SECRET_ENV}, **extra}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


GATEWAY = ["gateway", "serve", "--engine", "http://127.0.0.1:9"]


@pytest.mark.parametrize("command,host", [
    *((GATEWAY, host) for host in ("0.0.0.0", "::", "10.1.2.3", "example.internal")),
    (["engine", "serve", "--model", "/nonexistent"], "0.0.0.0"),
    (["engine", "vllm", "--model", "/nonexistent"], "::"),
])
def test_a_service_bound_beyond_loopback_without_credentials_refuses_to_start(command, host, tmp_path):
    port = free_port()
    run = subprocess.run([sys.executable, "-m", "forge_stream", *command, "--host", host, "--port", str(port),
                          "--bootstrap-servers", "127.0.0.1:9"], capture_output=True, text=True, timeout=120,
                         env=_clean_env(FORGE_HOME=str(tmp_path)))
    assert run.returncode == 2, run.stderr
    assert "refuses to listen" in run.stderr and (GATEWAY_ENV if command[0] == "gateway" else ENGINE_ENV) in run.stderr
    assert not _listening(port)


@pytest.mark.kafka
def test_a_gateway_on_every_interface_with_its_token_requires_it(kafka_bootstrap, tmp_path):
    port, token = free_port(), "t-" + os.urandom(16).hex()
    proc = start_process([sys.executable, "-m", "forge_stream", "gateway", "serve", "--host", "0.0.0.0", "--port",
                          str(port), "--engine", "http://127.0.0.1:9", "--bootstrap-servers", kafka_bootstrap],
                         tmp_path / "gateway.log", env=_clean_env(FORGE_HOME=str(tmp_path), **{GATEWAY_ENV: token}))
    try:
        wait_healthy("gateway", proc, url=f"http://127.0.0.1:{port}/health", log=tmp_path / "gateway.log",
                     timeout=120)
        url = f"http://127.0.0.1:{port}/v1/sessions"
        assert httpx.post(url, json={"group_id": "g", "task_id": "t"}).status_code == 401
        opened = httpx.post(url, json={"group_id": "g", "task_id": "t"}, headers={"Authorization": f"Bearer {token}"})
        assert opened.status_code == 201 and opened.json()["token"] != token
    finally:
        stop(proc)


def test_up_generates_credentials_once_readable_by_the_owner_alone(tmp_path):
    made, fresh = credentials.ensure(tmp_path / "home")
    file = credentials.path(tmp_path / "home")
    assert fresh and stat.S_IMODE(file.stat().st_mode) == 0o600
    assert len(made.gateway_admin_token) >= 40 and made.gateway_admin_token != made.engine_token
    os.chmod(file, 0o644)
    again, fresh = credentials.ensure(tmp_path / "home")
    assert (again, fresh) == (made, False) and stat.S_IMODE(file.stat().st_mode) == 0o600
    assert credentials.ensure(tmp_path / "other")[0] != made


def test_each_service_gets_only_the_tokens_it_uses_and_the_plan_never_shows_them(tmp_path):
    settings = ForgeSettings(home=tmp_path, bootstrap_servers="127.0.0.1:9")
    creds = credentials.Credentials("GATEWAY-SECRET", "ENGINE-SECRET")
    topology = load_topology("cluster")
    hosts = [h for hs in topology.hosts.values() for h in hs]
    env = {p.spec.name: p.spec.env for h in hosts for p in plan(settings, topology, h, creds)}
    assert env["gateway"][GATEWAY_ENV] == "GATEWAY-SECRET" and env["gateway"][ENGINE_ENV] == "ENGINE-SECRET"
    assert env["controller"][GATEWAY_ENV] == "GATEWAY-SECRET" and ENGINE_ENV not in env["controller"]
    assert env["engine"][ENGINE_ENV] == "ENGINE-SECRET" and GATEWAY_ENV not in env["engine"]
    for name in ("registry", "processors", "trainer"):
        assert not set(env[name]) & set(credentials.SECRET_ENV), name
    local = {p.spec.name: p.spec for p in plan(settings, load_topology("local"), None, creds)}
    argv = local["engine"].argv  # the torch engine loads weights over HTTP only from the home's checkpoints
    assert argv[argv.index("--checkpoint-dir") + 1] == str(settings.checkpoint_dir)
    shown = json.dumps(describe_plan(settings, topology))
    assert "SECRET" not in shown and GATEWAY_ENV in shown
    assert not credentials.path(tmp_path).exists()  # a dry run generates nothing


def test_the_supervisors_state_which_holds_the_services_environments_is_private(tmp_path):
    supervisor = Supervisor(tmp_path / "run")
    with supervisor.locked() as state:
        state["gateway"] = {"env": {GATEWAY_ENV: "secret"}}
    assert stat.S_IMODE(supervisor.state_file.stat().st_mode) == 0o600


AGENT = ("import json, os, sys; print(json.dumps({k: v for k, v in os.environ.items() "
         "if k.startswith(('FORGE_', 'OPENAI_'))}))")
POOLED = ("import json, os, sys\n"
          "for line in sys.stdin:\n"
          "    ep = json.loads(line)\n"
          "    env = {k: v for k, v in os.environ.items() if k.startswith(('FORGE_', 'OPENAI_'))}\n"
          "    print(json.dumps({'id': ep['id'], 'output': json.dumps({**env, 'api_key': ep['api_key']})}), flush=True)\n")


def test_an_agent_gets_its_session_token_and_none_of_the_controllers(tmp_path, monkeypatch):
    monkeypatch.setenv(GATEWAY_ENV, "ADMIN-SECRET")
    monkeypatch.setenv(ENGINE_ENV, "ENGINE-SECRET")
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    pooled = tmp_path / "pooled.py"
    pooled.write_text(POOLED)
    ctx = AgentContext("s1", "http://127.0.0.1:1/s/s1/v1", "fs-session-token", {"prompt": "x"})

    async def both():
        one = await CommandAgent(f"{sys.executable} {script}")(ctx)
        pool = PooledCommandAgent(f"{sys.executable} {pooled}", 1, 1, 30.0)
        try:
            return one, await pool(ctx)
        finally:
            await pool.aclose()

    for result in asyncio.run(both()):
        assert result.ok, result.reason
        seen = json.loads(result.output)
        assert "ADMIN-SECRET" not in result.output and "ENGINE-SECRET" not in result.output
        assert not set(seen) & set(credentials.SECRET_ENV)
        assert seen.get("OPENAI_API_KEY", seen.get("api_key")) == "fs-session-token"


def test_credentials_doctests_hold():
    import doctest

    assert doctest.testmod(credentials).failed == 0
