"""vLLM's control routes (`/collective_rpc`, `/pause`, reloads) are the engine's alone: vLLM listens on no TCP port,
only on a Unix socket in a folder of the engine's own that no other user can open; and a forge.policy record whose
checkpoint lies outside the engine's checkpoint store is refused, not loaded."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import tempfile
import time
import uuid

import httpx
import psutil
import pytest

from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from helpers import until
from vllm_support import vllm_socket

pytestmark = pytest.mark.slow

NOBODY = 65534


def test_vllm_listens_on_a_socket_only_its_engines_user_can_open(vllm_engine):
    sock = vllm_socket(vllm_engine.log)
    folder = sock.parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and folder.stat().st_uid == os.geteuid()
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30) as vllm:  # the engine's user can
        assert vllm.get("http://vllm/is_sleeping").json() == {"is_sleeping": False}

    # vLLM's server (the front's child) listens on no TCP port, and no port of the engine's processes but the
    # front's own answers vLLM's control routes
    front = psutil.Process(vllm_engine.pid)
    server, *_ = front.children()
    assert [c for c in server.net_connections("inet") if c.status == psutil.CONN_LISTEN] == []
    front_port = int(vllm_engine.url.rsplit(":", 1)[1])
    listening = {c.laddr.port for p in front.children(recursive=True) for c in p.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN} - {front_port}
    for port in listening:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/is_sleeping", timeout=5)
        except httpx.HTTPError:
            continue
        assert "is_sleeping" not in answer.text, (port, answer.text)

    if os.geteuid() != 0:
        return  # starting another user's process needs root; the modes above are what refuses one
    assert _connect_as(NOBODY, str(sock)) == "refused"
    # and from inside the folder, past its parents' modes: the folder's own refuses
    assert _connect_as(NOBODY, sock.name, cwd=folder) == "refused"


def _connect_as(uid: int, path: str, cwd=None) -> str:
    """Whether a process of user `uid` (forked from this one, root) can connect to the Unix socket at `path`."""
    pid = os.fork()
    if pid == 0:  # the child: no return from here
        code = 1
        try:
            if cwd is not None:
                os.chdir(cwd)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            socket.socket(socket.AF_UNIX).connect(path)
            code = 0
        except PermissionError:
            code = 13
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return {0: "connected", 13: "refused"}.get(code, f"failed (exit {code})")


def test_a_version_outside_the_checkpoint_store_is_refused(vllm_engine, checkpoints):
    before = vllm_engine.health()
    outside = tempfile.mkdtemp(prefix="forge-outside-store-")  # not under the pytest folders, the engine's store
    try:
        shutil.copytree(checkpoints[2], outside, dirs_exist_ok=True)
        producer = EventProducer(vllm_engine.bootstrap)
        version = before["policy_version"] + 1
        producer.send_sync(TOPICS.policy, vllm_engine.run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version, "step": 0,
            "checkpoint_uri": outside, "base_model": outside})
        producer.close()
        until(lambda: f"policy version {version} at {outside} is not served: it is outside the engine's checkpoint "
              "directory" in vllm_engine.log.read_text(), 60, lambda: vllm_engine.log.read_text()[-3000:])
    finally:
        shutil.rmtree(outside, ignore_errors=True)
    now = vllm_engine.health()
    assert (now["policy_version"], now["checkpoint"], now["loads"]) == (
        before["policy_version"], before["checkpoint"], before["loads"])
