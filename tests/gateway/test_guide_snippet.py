"""The agents guide's first snippet runs as pasted: against a gateway with auth on (its admin token in the home's
credentials.json, as `forge-stream up` writes it), on the port FORGE_GATEWAY_PORT names, it opens a session, gets a
tool call through the `openai` SDK, rewards and finishes it, and the gateway records the session."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import read_events, serving

from forge_stream.gateway.app import create_app
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]


def test_the_agents_guide_snippet_runs_as_pasted(tmp_path, kafka_bootstrap, scripted_url):
    [snippet] = [b for b in re.findall(r"^```python\n(.*?)^```", (REPO / "docs/guides/agents.md").read_text(),
                                       re.S | re.M) if "OpenAI(" in b][:1]
    assert "..." not in snippet  # nothing to fill in
    home = tmp_path / "home"
    home.mkdir()
    token = "admin-" + "x" * 40
    (home / "credentials.json").write_text(json.dumps({"gateway_admin_token": token}))
    settings = GatewaySettings(engines=(scripted_url,), bootstrap=kafka_bootstrap, admin_token=token)
    with serving(create_app(settings)) as url:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("FORGE_")},
               "FORGE_HOME": str(home), "FORGE_GATEWAY_PORT": url.rsplit(":", 1)[1]}
        ran = subprocess.run([sys.executable, "-c", snippet], env=env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "get_weather" in ran.stdout, ran.stdout  # the scripted engine's tool call, parsed by the SDK
    completions = read_events(kafka_bootstrap, TOPICS.completions, lambda r: r["group_id"] == "g1")
    finished = read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["group_id"] == "g1" and "status" in r)
    assert completions and finished, "the gateway recorded nothing of the snippet's session"
