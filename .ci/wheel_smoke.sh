#!/usr/bin/env bash
# The wheel as a user installs it: build it, install it into a fresh virtualenv outside the checkout, and from an
# empty directory run `forge-stream up`, the README's tour (4 groups of 4), `status` and `down`.
#
# Run it from the project's environment (`. .venv/bin/activate && bash .ci/wheel_smoke.sh`). The fresh virtualenv
# takes the dependencies from that environment (its site-packages on the path through a .pth file), so torch is not
# downloaded twice; forge_stream, topologies and connectors, the files they read (schemas, the broker's Maven project,
# the example agent) and the `forge-stream` command come from the wheel alone: a check below fails if any directory
# on the path other than the wheel's holds one of those packages, and nothing runs from the checkout (an empty
# working directory, PYTHONPATH unset). The Kafka jars and the warm-started demo model come from the cache
# (~/.cache/forge-stream) when an earlier `up` or the tests built them, as on a user's second install.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
started=$SECONDS

echo "== wheel (built from $repo)"
python -m pip wheel --no-deps --quiet --wheel-dir "$work/dist" "$repo"
deps="$(python -c 'import site; print("\n".join(site.getsitepackages()))')"
python -m venv --without-pip "$work/venv"
python -m pip --python "$work/venv/bin/python" install --quiet --no-deps --no-index "$work"/dist/*.whl
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
echo "$deps" > "$site/zz_forge_smoke_dependencies.pth"  # after the wheel's own site-packages on sys.path

cd "$work"
unset PYTHONPATH
for name in $(compgen -e | grep '^FORGE_' || true); do unset "$name"; done
export PATH="$work/venv/bin:$PATH"
python - "$site" <<'EOF'
"""The wheel's packages and files are the ones found, and no other directory on the path could stand in."""
import sys
from pathlib import Path

import connectors
import forge_stream
import topologies
from forge_stream.events.registry import load_registry
from forge_stream.kafka.broker import INFRA_DIR
from forge_stream.shipped import ROOT, shipped

site = Path(sys.argv[1]).resolve()
for module in (forge_stream, topologies, connectors):
    assert Path(module.__file__).resolve().is_relative_to(site), f"{module.__name__} from {module.__file__}"
others = [p for p in sys.path if p and Path(p).resolve() != site
          and any((Path(p) / name / "__init__.py").exists() for name in ("forge_stream", "topologies", "connectors"))]
assert not others, f"the path holds another copy of the packages: {others}"
assert ROOT == site / "forge_stream" / "_data", ROOT
for name in ("schemas/registry.json", "examples/agents/tool_agent.py", "examples/tasks_arith.jsonl"):
    assert shipped(name).is_file(), name
assert {p.name for p in INFRA_DIR.iterdir()} >= {"pom.xml", "server.properties.template", "log4j2.yaml"}
from forge_stream.balancer import CONFIG_TEMPLATE, render
assert CONFIG_TEMPLATE.resolve().is_relative_to(site), CONFIG_TEMPLATE  # `gateway balance` reads the wheel's
(Path.cwd() / "haproxy.cfg").write_text(render(["127.0.0.1:18001", "127.0.0.1:18002"], port=18000))
print(f"the wheel's packages in {site}; {len(load_registry().by_id)} schemas; nothing from the checkout")
EOF
# the load balancer's config as `gateway balance` renders it from the wheel: HAProxy accepts it
"$(command -v haproxy || echo /usr/sbin/haproxy)" -c -f haproxy.cfg

free_port() { python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
for port in KAFKA_PORT KAFKA_CONTROLLER_PORT REGISTRY_PORT ENGINE_PORT GATEWAY_PORT; do
  export "FORGE_${port}=$(free_port)"
done
export FORGE_HOME="$work/home"
trap 'forge-stream down >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

echo "== forge-stream up (from $PWD)"
forge-stream up
echo "== the tour: 4 groups of 4 with the shipped example agent"
forge-stream rollout run --tasks 'suite:train?seed=1' --max-groups 4 --group-size 4 \
    --agent "python examples/agents/tool_agent.py --serve" --agent-workers 2 --json | tee rollout.json
python - <<'EOF'
"""The trainer steps on the tour's groups and the engine loads the new policy (as the tour says, within minutes)."""
import os
import time

import httpx

engine = f"http://127.0.0.1:{os.environ['FORGE_ENGINE_PORT']}/health"
deadline = time.monotonic() + 300
while httpx.get(engine).json()["policy_version"] < 1 and time.monotonic() < deadline:
    time.sleep(2)
version = httpx.get(engine).json()["policy_version"]
assert version >= 1, f"no trained policy reached the engine in 5 minutes: see {os.environ['FORGE_HOME']}/run/*.log"
print(f"the engine serves policy version {version}")
EOF
forge-stream status
forge-stream status --json > status.json
python - <<'EOF'
"""The tour's groups went through the whole pipeline: rolled out, packed into samples, nothing dead-lettered."""
import json

rollout = json.load(open("rollout.json"))
assert rollout["groups"] == 4 and rollout["sessions"] == 16 and rollout["failed_sessions"] == 0, rollout
status = json.load(open("status.json"))
topics = status["topics"]
assert topics["forge.completions"]["messages"] >= 16 and topics["forge.samples"]["messages"] >= 1, topics
assert topics["forge.dlq"]["messages"] == 0, topics
assert all(s["healthy"] for s in status["services"].values()), status["services"]
print(f"rollout: {rollout['groups']} groups, {rollout['sessions']} sessions; "
      f"{topics['forge.completions']['messages']} completions recorded")
EOF
echo "== forge-stream down"
forge-stream down
echo "wheel smoke test passed in $((SECONDS - started)) s"
