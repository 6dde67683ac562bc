"""The pure parts of how the vLLM front loads a version: the load plan, the checksum proof, the version gate of
`engine vllm`, its held checkpoints and its vLLM child's end.
What they do against the real server is tested in tests/vllm/."""

import asyncio
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from forge_stream.engine.shared.probe import probe_ids
from forge_stream.engine.vllm_front.holds import HOLDS_PREFIX, hold_checkpoint, weights_fingerprint
from forge_stream.engine.vllm_front.load_plan import (EMPTY, WorkerError, announce_plan, checkpoint_digests,
                                                      comparable, load_plan, prove)
from forge_stream.engine.vllm_front.state import VersionGate
from forge_stream.files import remove_orphaned
from forge_stream.proc import alive


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def test_the_plan_loads_by_path_and_announces_only_after():
    """Loading pauses the server before it swaps the weights in from the given path, and neither names a version nor
    serves again: that is the announcement's, made once the weights are proven, which names the version, drops the
    prefix cache (its KV came from the old weights) and resumes last."""
    load = load_plan("/ckpt/v7")
    paths = [c.path for c in load]
    rpc = next(c for c in load if c.path == "/collective_rpc")
    assert "/pause" in paths and paths.index("/pause") < paths.index("/collective_rpc")
    assert "/ckpt/v7" in rpc.body["kwargs"].values() and load_plan("/ckpt/v8") != load
    assert not {"/update_weight_version", "/resume", "/reset_prefix_cache"} & set(paths)
    assert not any(c.body and c.body.get("method") == "update_config" for c in load)  # 500 on the real server
    announce = announce_plan(7, reset_external=True)
    assert [c.path for c in announce][-1] == "/resume" and "/reset_prefix_cache" in [c.path for c in announce]
    assert "7" in json.dumps([c.body for c in announce]) and "7" not in json.dumps([c.body for c in announce_plan(8)])
    assert announce_plan(7) != announce  # the external KV tier is dropped only when asked


def test_comparable_checksums_drop_repacked_and_sharded_weights():
    served = {"dp0:pp0:pcp0:tp0:model.norm.weight": "a", "dp0:pp0:pcp0:tp1:model.norm.weight": "a",
              "dp0:pp0:pcp0:tp0:model.embed_tokens.weight": "b", "dp0:pp0:pcp0:tp1:model.embed_tokens.weight": "c",
              "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight": EMPTY}
    assert comparable(served) == {"model.norm.weight": "a"}


def test_checkpoint_digests_are_vllms_digests_of_the_same_bytes(tmp_path):
    weights = {"model.norm.weight": torch.randn(8), "model.embed_tokens.weight": torch.randn(100, 8)}
    save_file(weights, tmp_path / "model.safetensors")
    got = checkpoint_digests(tmp_path, {"model.norm.weight", "model.embed_tokens.weight", "not.there"}, "float32")
    assert got["model.norm.weight"] == (_sha(weights["model.norm.weight"]),)
    padded = torch.cat([weights["model.embed_tokens.weight"], torch.zeros(28, 8)])  # vLLM: rows to a multiple of 64
    assert got["model.embed_tokens.weight"] == (_sha(weights["model.embed_tokens.weight"]), _sha(padded))
    assert checkpoint_digests(tmp_path, {"model.norm.weight"}, "bfloat16")["model.norm.weight"] == (_sha(
        weights["model.norm.weight"].to(torch.bfloat16)),)
    with pytest.raises(WorkerError, match="no \\*.safetensors"):
        checkpoint_digests(tmp_path / "missing", {"x"}, "float32")


def test_the_proof_needs_equal_checksums_and_changed_fused_weights():
    expected = {"norm": ("n1",), "embed": ("e1", "e1-padded")}
    assert prove({"norm": "n1", "embed": "e1-padded", "qkv": "q1"}, expected,
                 {"norm": "n0", "embed": "e0", "qkv": "q0"}).__dict__ == {"matched": 2, "fused_changed": 1, "fused": 1}
    with pytest.raises(WorkerError, match="differ from the checkpoint's in 1 of 2"):
        prove({"norm": "n0", "embed": "e1"}, expected, None)  # the server still holds the old norm
    with pytest.raises(WorkerError, match="no parameter"):
        prove({"qkv": "q1"}, expected, None)
    with pytest.raises(WorkerError, match="partial"):
        prove({"norm": "n1", "embed": "e1", "qkv": "q0"}, expected, {"norm": "n0", "embed": "e0", "qkv": "q0"})


def test_the_gate_labels_requests_and_updates_only_between_them():
    async def scenario():
        gate = VersionGate(3)
        first = await gate.enter()
        closing = asyncio.create_task(gate.close())
        await asyncio.sleep(0.01)
        assert not closing.done()  # a request is in flight: the update waits for it
        late = asyncio.create_task(gate.enter())
        await asyncio.sleep(0.01)
        assert not late.done()  # a new request waits while the update is pending
        gate.leave()
        await closing
        assert not late.done()
        gate.reopen(4)
        return first, await late

    assert asyncio.run(scenario()) == (3, 4)


def test_the_probe_spreads_over_the_vocabulary():
    ids = probe_ids(980)
    assert len(ids) == 48 and len(set(ids)) > 40 and max(ids) < 980 and probe_ids(980) == ids


def test_a_held_checkpoint_outlives_the_trainers_rotation(tmp_path):
    checkpoint, holds = tmp_path / "checkpoints" / "v000007-ab12cd34", tmp_path / "held"
    checkpoint.mkdir(parents=True)
    holds.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    (checkpoint / "config.json").write_text("{}")
    held = hold_checkpoint(str(checkpoint), holds, 7)
    assert held.parent == holds and held.name.startswith("v000007-")
    assert (held / "model.safetensors").stat().st_ino == (checkpoint / "model.safetensors").stat().st_ino  # linked
    shutil.rmtree(checkpoint)  # the trainer keeps only its newest few
    assert (held / "model.safetensors").read_bytes() == b"weights" and (held / "config.json").read_text() == "{}"
    with pytest.raises(OSError, match="cannot hold"):
        hold_checkpoint(str(checkpoint), holds, 8)
    assert [p.name for p in holds.iterdir()] == [held.name]  # a failed hold leaves nothing behind


def test_the_vllm_child_ends_with_its_front(tmp_path):
    """vLLM runs in a session of its own; killed however, its front must not leave it running."""
    pid_file = tmp_path / "child.pid"
    front = subprocess.Popen([sys.executable, "-c", (
        "import sys, subprocess, time\n"
        "from forge_stream.proc import start_process\n"
        "from forge_stream.engine.vllm_front.app import _end_with_parent\n"
        "child = start_process([sys.executable, '-c', 'import time; time.sleep(120)'], new_session=True,"
        " preexec_fn=_end_with_parent)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(120)\n")])
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and front.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert os.getpgid(child) == child  # out of reach of a signal to the front's group
    front.send_signal(signal.SIGKILL)
    front.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, f"pid {child} outlived its killed front"
        time.sleep(0.05)



def test_an_engine_that_cannot_recover_ends_at_once_and_takes_vllm_with_it(tmp_path):
    """`exit_engine` (a version that cannot be loaded back): vLLM stopped, then the process gone with exit code 3 for its
    supervisor to restart, not a graceful shutdown waiting on requests held at a closed gate."""
    pid_file = tmp_path / "child.pid"
    front = subprocess.run([sys.executable, "-c", (
        "import asyncio, sys\n"
        "from pathlib import Path\n"
        "from forge_stream.proc import start_process\n"
        "from forge_stream.engine.vllm_front import state as ve\n"
        "child = start_process([sys.executable, '-c', 'import time; time.sleep(120)'], new_session=True)\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        f"holds = Path({str(tmp_path / 'held')!r}); holds.mkdir()\n"
        "state = ve.EngineState(settings=None, gate=ve.VersionGate(4), holds=holds, proc=child)\n"
        "async def main():\n"
        "    await state.gate.enter()  # a request held forever\n"
        "    ve.exit_engine(state, 'vLLM could not load version 4 back either')\n"
        "asyncio.run(main())\n"
        "print('still running')\n")], capture_output=True, text=True, timeout=60)
    assert front.returncode == 3, front.stdout + front.stderr
    assert "still running" not in front.stdout and "starts afresh" in front.stderr
    assert not alive(int(pid_file.read_text())) and not (tmp_path / "held").exists()


def test_holds_of_engines_that_are_gone_are_removed_at_start(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live = tmp_path / f"{HOLDS_PREFIX}{gone.pid}-x1", tmp_path / f"{HOLDS_PREFIX}{os.getpid()}-x2"
    other = tmp_path / f"{HOLDS_PREFIX}notes"
    for folder in (stale, live, other):
        (folder / "v000003-aa").mkdir(parents=True)
    remove_orphaned(tmp_path, HOLDS_PREFIX)
    assert not stale.exists() and live.exists() and other.exists()


def test_the_weights_fingerprint_is_the_safetensors_bytes(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for folder, value in ((a, 1.0), (b, 1.0), (c, 2.0)):
        folder.mkdir()
        save_file({"w": torch.full((4, 4), value)}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(f'{{"note": "{folder.name}"}}')  # not weights: not fingerprinted
    assert weights_fingerprint(a) == weights_fingerprint(b) != weights_fingerprint(c)
    assert weights_fingerprint(tmp_path) is None  # no weight file: never taken for the served weights
