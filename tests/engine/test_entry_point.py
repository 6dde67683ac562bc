"""The engine process has an entry point of its own: `python -m forge_stream.engine serve|vllm` (what `up` and
EngineProcess start) takes the same commands as `forge-stream engine`, and imports none of the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

RUN = ("import json, runpy, sys\n"
       "sys.argv = ['forge_stream.engine', *sys.argv[1:]]\n"
       "try:\n"
       "    runpy.run_module('forge_stream.engine', run_name='__main__')\n"
       "except SystemExit as exc:\n"
       "    code = exc.code\n"
       "print(json.dumps({'code': code, 'cli': sorted(m for m in sys.modules if m.startswith('forge_stream.cli'))}))\n")


def test_the_engine_entry_point_serves_the_engine_commands_without_the_command_line():
    for command in ("serve", "vllm"):
        done = subprocess.run([sys.executable, "-c", RUN, command, "--help"], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "COLUMNS": "300"})  # no option name cut short
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result == {"code": 0, "cli": []}, done.stdout + done.stderr
        assert "--checkpoint-dir" in done.stdout and "--bootstrap-servers" in done.stdout
