"""A user's mistake ends in one line saying what to do and exit status 2, never a traceback: a missing or broken
tasks file, an unknown suite split, a run with no data to plot. The task errors come before any Kafka is needed
(the commands are pointed at a port where nothing listens)."""

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from forge_stream.cli import app

NOWHERE = "127.0.0.1:9"


def forge(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forge_stream", *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "FORGE_HOME": str(tmp_path / "home")})


@pytest.mark.parametrize("command", [["rollout", "run"], ["eval", "--limit", "2"]])
@pytest.mark.parametrize("tasks, says", [
    ("no-such-file.jsonl", "no task file 'no-such-file.jsonl'"),
    ("suite:heldot", "split must be one of train, validation, test"),
    ("suite:train?mix=agnt=1", "unknown task domains ['agnt']"),
])
def test_a_bad_tasks_option_is_one_line_and_exit_2(command, tasks, says, tmp_path):
    done = forge(*command, "--tasks", tasks, "--agent", "true", "--bootstrap-servers", NOWHERE, tmp_path=tmp_path)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"error: --tasks {tasks}: ")
    assert says in done.stderr


def test_a_tasks_file_with_a_line_that_is_no_task_names_the_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "t1", "prompt": {"question": "1?"}}\n{"prompt": {}}\n')
    done = forge("rollout", "run", "--tasks", str(tasks), "--agent", "true", "--bootstrap-servers", NOWHERE,
                 tmp_path=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: --tasks {tasks}: {tasks}:2: not a task (KeyError: 'task_id')"]


@pytest.mark.kafka
def test_plot_rewards_of_a_run_with_no_data_fails_and_writes_nothing(kafka_bootstrap, run_id, tmp_path):
    out = tmp_path / "rewards.png"
    result = CliRunner().invoke(app, ["plot", "rewards", "--out", str(out), "--run", f"{run_id}-nosuchrun",
                                      "--bootstrap-servers", kafka_bootstrap])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        f"error: run '{run_id}-nosuchrun' has no TrainStep on forge.train_metrics and no EvalResult on forge.evals: "
        "nothing to plot (--run takes the trainer's run name; without it, the run that trained last)"]
    assert not out.exists()
