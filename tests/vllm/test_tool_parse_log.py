"""A tool call the model wrote that does not parse is the policy's mistake, not the server's: in the vLLM servers
forge-stream starts, vLLM's hermes parser reports it as one WARNING line that says so (vllm_ext/sitecustomize.py),
not as an ERROR with a traceback in the engine's log."""

from __future__ import annotations

import subprocess

import pytest

from forge_stream.engine.vllm_runtime import runtime, vllm_env
from forge_stream.settings import ForgeSettings

# what vLLM 0.32's HermesToolParser does when a <tool_call> block's JSON does not load
PARSE_FAILURE = """
import json, logging, sys
from vllm.tool_parsers import hermes_tool_parser
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
hermes_tool_parser.logger.addHandler(handler)
hermes_tool_parser.logger.propagate = False
try:
    json.loads('{"name": "calculator", "arguments": {"expression": "3 +')
except Exception:
    hermes_tool_parser.logger.exception("Error in extracting tool call from response.")
print("parser file:", hermes_tool_parser.__file__)
"""


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_tool_call_that_does_not_parse_is_one_warning_line(tmp_path, target):
    rt = runtime(ForgeSettings().cache_dir, "cpu")
    assert rt.ready(), "the vLLM runtime is not installed: forge-stream engine install-vllm"
    out = subprocess.run([str(rt.python), "-c", PARSE_FAILURE], env=vllm_env(tmp_path, target), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    source = out.stdout.split("parser file:")[-1].strip()
    with open(source) as f:  # the message the filter matches is still the one vLLM's parser logs
        assert 'logger.exception("Error in extracting tool call from response.")' in f.read()
    [line] = [line for line in out.stderr.splitlines() if "<tool_call>" in line]
    assert "WARNING" in line and "JSONDecodeError" in line and "tool_call_error" in line, line
    assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-2000:]
