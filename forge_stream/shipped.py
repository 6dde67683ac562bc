"""The files forge-stream reads at run time besides its modules, found the same way in a checkout and in a wheel.

They live at the repository's top level: the Avro schemas (`schemas/`), the local broker's Maven project and
configuration (`infra/kafka/`), the gateway hosts' HAProxy configuration (`infra/haproxy/`), and the example agents and tasks (`examples/`: the tour, the `learn` topology and
the learning benchmark run `examples/agents/tool_agent.py`). A wheel carries the same files under
`forge_stream/_data/` (pyproject.toml's `[tool.hatch.build.targets.wheel.sources]`); a checkout, or an editable
install of one, has no `_data/` and reads them in place. The topologies' YAML ships inside the `topologies` package,
which sits beside `forge_stream` in both layouts. `forge-stream docs generate` reads a checkout (`--root`) instead:
it is a developer command.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE / "_data" if (PACKAGE / "_data").is_dir() else PACKAGE.parent


def shipped(relative: str) -> Path:
    """The shipped file or folder that `relative` names as the repository does (`schemas/registry.json`)."""
    return ROOT / relative


def command_line(command: str) -> str:
    """An agent's command line as the README and the topologies write it, made runnable from any directory:
    `python` is this interpreter, and a relative path that names no file here but a shipped one
    (`examples/agents/tool_agent.py`) becomes the shipped file's absolute path."""
    words = shlex.split(command)
    if words and words[0] in ("python", "python3"):
        words[0] = sys.executable
    return shlex.join(file_argument(w) for w in words)


def file_argument(word: str) -> str:
    """`word` as an absolute path if it names a file (here, else among the shipped ones); any other word as is."""
    path = Path(word)
    if path.is_absolute():
        return word
    if _is_file(path):
        return str(path.resolve())
    return str(shipped(word)) if _is_file(shipped(word)) else word


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; a word no file can have (too long, a NUL byte: `python -c '...'`) is none."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False
