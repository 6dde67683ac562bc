"""The shared KV tier's pieces that need no engine: the LMCache server's command line (checked against the real
`lmcache server` of the vLLM runtime), the connector vLLM is given on CPU and GPU hosts, the topology's keys, and
cache salts LMCache accepts for any run name."""

import json
import os
import subprocess

import pytest
from hypothesis import given, strategies as st

from forge_stream.engine.vllm_front.runtime import runtime
from forge_stream.kvtier import SALT_MAX, TierSettings, cache_salt, connector_args, server_argv
from forge_stream.settings import ForgeSettings


def test_the_connector_recomputes_a_lost_tier_and_copies_by_the_hosts_best_path():
    cpu = json.loads(connector_args("127.0.0.1:6555", "cpu")[0].split("=", 1)[1])
    gpu = json.loads(connector_args("10.0.0.5:7000", "gpu")[0].split("=", 1)[1])
    for config in (cpu, gpu):
        assert config["kv_connector"] == "LMCacheMPConnector" and config["kv_role"] == "kv_both"
        assert config["kv_load_failure_policy"] == "recompute"  # a lost tier is recomputed, never failed
    assert cpu["kv_connector_extra_config"]["lmcache.mp.mp_transfer_mode"] == "lmcache_driven"
    assert "lmcache.mp.mp_transfer_mode" not in gpu["kv_connector_extra_config"]  # LMCache's choice: CUDA IPC
    assert gpu["kv_connector_extra_config"]["lmcache.mp.host"] == "tcp://10.0.0.5"
    assert gpu["kv_connector_extra_config"]["lmcache.mp.port"] == 7000
    assert connector_args("127.0.0.1:6555", "cpu")[1] == "--disable-hybrid-kv-cache-manager"
    with pytest.raises(ValueError, match="HOST:PORT"):
        connector_args("6555", "cpu")


def test_the_servers_transfer_mode_follows_the_host_unless_the_topology_names_one():
    def mode(argv):
        return argv[argv.index("--supported-transfer-mode") + 1]

    assert mode(server_argv("python", TierSettings(), "cpu")) == "lmcache_driven"
    assert mode(server_argv("python", TierSettings(), "gpu")) == "auto"
    assert mode(server_argv("python", TierSettings(transfer_mode="engine_driven"), "gpu")) == "engine_driven"


def test_the_topologys_keys_are_checked():
    tier = TierSettings.from_options({"kind": "lmcache", "l1_size_gb": 4, "bind": "0.0.0.0",
                                      "l2_adapters": [{"type": "resp", "host": "r", "port": 6379}]})
    assert (tier.l1_size_gb, tier.host) == (4, "0.0.0.0")
    assert json.loads(tier.l2_adapters[0]) == {"type": "resp", "host": "r", "port": 6379}
    with pytest.raises(ValueError, match="unknown keys l1_size"):
        TierSettings.from_options({"l1_size": 4})
    with pytest.raises(ValueError, match="unknown kind 'redis'"):
        TierSettings.from_options({"kind": "redis"})


@given(st.text(min_size=1, max_size=300), st.integers(0, 2**31 - 1), st.one_of(st.none(), st.text(max_size=80)))
def test_every_salt_is_one_lmcache_takes_and_versions_never_share_one(run, version, adapter):
    salt = cache_salt(run, version, adapter)
    assert len(salt) <= SALT_MAX and not set("@/\\\x00") & set(salt)
    assert salt != cache_salt(run, version + 1, adapter)


def test_the_tier_service_passes_only_flags_lmcache_server_takes():
    rt = runtime(ForgeSettings().cache_dir)
    if not rt.ready():
        if os.environ.get("CI"):
            pytest.fail("CI installs the vLLM runtime (with LMCache) before the tests: `forge-stream engine "
                        "install-vllm`")
        pytest.skip("the vLLM runtime is not installed here: forge-stream engine install-vllm")
    help_text = subprocess.run([str(rt.python), "-m", "lmcache.cli.main", "server", "--help"], capture_output=True,
                               text=True, timeout=120, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"}).stdout
    argv = server_argv(rt.python, TierSettings(l2_adapters=('{"type":"resp","host":"r","port":1}',),
                                               max_workers=2), rt.target)
    for flag in (word for word in argv if word.startswith("--")):
        assert f"{flag} " in help_text or f"{flag}\n" in help_text, f"lmcache server takes no {flag}"


def test_the_kv_caches_of_gone_engines_are_unlinked_and_live_ones_kept(tmp_path):
    from forge_stream.kvtier import remove_orphaned_kv

    gone = _a_dead_pid()
    for name in (f"lmcache_kv_{gone}_0", f"lmcache_kv_{os.getpid()}_0", "lmcache_kv_x_0", "other_123_0"):
        (tmp_path / name).write_bytes(b"kv")
    assert remove_orphaned_kv(tmp_path) == [f"lmcache_kv_{gone}_0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"lmcache_kv_{os.getpid()}_0", "lmcache_kv_x_0", "other_123_0"])


def _a_dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("module", ["forge_stream.kvtier", "forge_stream.engine.vllm_front.app",
                                    "forge_stream.engine.vllm_front.state", "forge_stream.bench.learning"])
def test_doctests_hold(module):
    """The salt, the tier's counters, the engine's `prompt_cache` and a run's `prompt_sources`, by example."""
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
