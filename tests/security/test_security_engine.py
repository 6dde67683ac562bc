"""The torch engine as an attacker on its host sees it: with a token every route but /health needs it, and
`load_weights` loads only directories inside the engine's checkpoint directory, however the path is spelled."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import httpx
import pytest

from forge_stream.engine.shared.process import EngineProcess

from early import EARLY

TOKEN = secrets.token_urlsafe(32)
HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _engine(get):
    tiny_model_dir, checkpoints = get("tiny_model_dir"), get("tmp_path_factory").mktemp("checkpoints")
    shutil.copytree(get("tiny_model_dir_v1"), checkpoints / "v000001")
    os.symlink(tiny_model_dir, checkpoints / "escape")  # inside by name, outside once resolved
    log = get("tmp_path_factory").mktemp("engine_log") / "engine.log"
    proc = EngineProcess(str(tiny_model_dir), log_path=log, extra_args=(
        "--token", TOKEN, "--checkpoint-dir", str(checkpoints)))
    return lambda: (proc.start(), checkpoints)


EARLY.declare("token_engine", lambda item: item.path == Path(__file__) and "engine" in item.fixturenames, _engine,
              stop=lambda started: started[0].stop())


@pytest.fixture(scope="module")
def engine(request):
    """An engine with a token and a checkpoint directory holding one checkpoint (v1) and a link out of it (started
    in the background from the session's start: tests/early.py)."""
    proc, checkpoints = EARLY.take("token_engine", request.getfixturevalue)
    try:
        yield proc.url, checkpoints
    finally:
        proc.stop()


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.mark.slow
def test_every_route_but_health_needs_the_engines_token(engine):
    url, checkpoints = engine
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, _auth("wrong"), _auth(TOKEN[:-1]), {"Authorization": TOKEN}, _auth(TOKEN + " x")):
        for method, path, body in (("POST", "/v1/chat/completions", HI), ("GET", "/v1/models", None),
                                   ("POST", "/v1/admin/load_weights",
                                    {"path": str(checkpoints / "v000001"), "version": 9})):
            response = httpx.request(method, f"{url}{path}", json=body, headers=headers)
            assert response.status_code == 401, (path, headers, response.text)
            assert response.json()["error"]["code"] is None
    assert httpx.get(f"{url}/health").json()["policy_version"] == 0  # nothing was loaded
    assert httpx.post(f"{url}/v1/chat/completions", json=HI, headers=_auth(TOKEN)).status_code == 200


def test_load_weights_loads_only_inside_the_checkpoint_directory(engine, tiny_model_dir):
    url, checkpoints = engine
    outside = [str(tiny_model_dir), "/etc", "/", str(checkpoints / ".." / tiny_model_dir.parent.name),
               str(checkpoints / "v000001" / ".." / ".."), str(checkpoints / "escape"), "../../../../etc",
               str(checkpoints) + "-sibling"]
    for path in outside:
        response = httpx.post(f"{url}/v1/admin/load_weights", json={"path": path, "version": 5},
                              headers=_auth(TOKEN))
        assert response.status_code == 403, (path, response.text)
        assert str(tiny_model_dir) not in response.text and str(checkpoints) not in response.text
    missing = httpx.post(f"{url}/v1/admin/load_weights", json={"path": str(checkpoints / "v000002"), "version": 2},
                         headers=_auth(TOKEN))
    assert missing.status_code == 404
    assert httpx.get(f"{url}/health").json()["policy_version"] == 0
    loaded = httpx.post(f"{url}/v1/admin/load_weights", json={"path": str(checkpoints / "v000001"), "version": 1},
                        headers=_auth(TOKEN), timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert httpx.get(f"{url}/health").json()["policy_version"] == 1
