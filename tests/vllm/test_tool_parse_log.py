"""A tool call the model wrote that does not parse is the policy's mistake, not the server's: in the vLLM servers
forge-stream starts, vLLM's hermes parser reports it as one WARNING line that says so (vllm_ext/sitecustomize.py),
not as an ERROR with a traceback in the engine's log."""

from __future__ import annotations

import subprocess

import pytest

from forge_stream.engine.vllm_front.runtime import runtime, vllm_env
from forge_stream.settings import ForgeSettings

pytestmark = pytest.mark.slow

# vLLM's own hermes parser, on the tiny model's tokenizer, given a <tool_call> block whose JSON does not load
PARSE_FAILURE = """
import logging, sys
from transformers import AutoTokenizer
from vllm.tool_parsers import hermes_tool_parser
handler = logging.StreamHandler(sys.stderr)
handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
hermes_tool_parser.logger.addHandler(handler)
hermes_tool_parser.logger.propagate = False
parser = hermes_tool_parser.Hermes2ProToolParser(AutoTokenizer.from_pretrained({model!r}))
text = '<tool_call>{{"name": "calculator", "arguments": {{"expression": "3 +</tool_call>'
print("tools called:", parser.extract_tool_calls(text, None).tools_called)
"""


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_a_tool_call_that_does_not_parse_is_one_warning_line(tmp_path, target, tiny_model_dir):
    rt = runtime(ForgeSettings().cache_dir, "cpu")
    assert rt.ready(), "the vLLM runtime is not installed: forge-stream engine install-vllm"
    out = subprocess.run([str(rt.python), "-c", PARSE_FAILURE.format(model=str(tiny_model_dir))],
                         env=vllm_env(tmp_path, target), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tools called: False" in out.stdout, out.stdout  # answered as text, as before
    [line] = [line for line in out.stderr.splitlines() if "<tool_call>" in line]
    assert "WARNING" in line and "JSONDecodeError" in line and "tool_call_error" in line, line
    assert "Traceback" not in out.stderr and "ERROR" not in out.stderr, out.stderr[-2000:]
