"""`forge-stream eval` on the real broker, through the real gateway and scripted engine, with the pooled tool
agent: EvalResults per domain on forge.evals, sessions marked as evaluation, no Task published."""

import doctest
import json
import subprocess
import sys
from pathlib import Path

from helpers import read_events
from scripted_gateway import POLICY_VERSION

from forge_stream.rollout import evaluate
from forge_stream.rollout.episode import SessionOutcome
from forge_stream.topics import TOPICS

REPO = Path(__file__).resolve().parents[2]
AGENT = f"{sys.executable} {REPO / 'examples' / 'agents' / 'tool_agent.py'} --serve"


def test_doctests():
    result = doctest.testmod(evaluate)
    assert result.attempted >= 5 and result.failed == 0


def test_score_counts_failures_as_zero_and_adds_all():
    outcomes = [SessionOutcome("a", "t", "qa", 1.0, True), SessionOutcome("b", "t", "qa", None, False, "boom"),
                SessionOutcome("c", "t", "agent", 0.5, True), SessionOutcome("d", "t", "agent", 1.0, True)]
    scores = {s.domain: s for s in evaluate.score(outcomes)}
    assert list(scores) == ["agent", "qa", "all"]
    assert (scores["qa"].episodes, scores["qa"].failed, scores["qa"].mean) == (2, 1, 0.5)
    assert scores["agent"].mean == 0.75 and scores["agent"].low < 0.75 < scores["agent"].high
    assert (scores["all"].episodes, scores["all"].failed, scores["all"].mean) == (4, 1, 0.625)


def eval_cli(kafka_bootstrap, gateway, tasks, *args):
    return subprocess.run([sys.executable, "-m", "forge_stream", "eval", "--tasks", str(tasks), "--agent", AGENT,
                           "--agent-workers", "1", "--gateway-url", gateway, "-b", kafka_bootstrap, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def test_eval_publishes_results_per_domain_and_no_task(kafka_bootstrap, gateway, run_id, tmp_path):
    tasks = tmp_path / "heldout.jsonl"
    lines = [{"task_id": f"{run_id}-a{i}", "domain": "agent", "grader": "numeric",
              "prompt": {"question": "What is 6 * 7?", "answer": "42", "max_tokens": 100}} for i in range(4)]
    lines += [{"task_id": f"{run_id}-r{i}", "domain": "reasoning", "grader": "numeric",
               "prompt": {"question": "What is 3 + 4?", "answer": "42" if i < 2 else "7", "max_tokens": 100}}
              for i in range(4)]
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))

    out = eval_cli(kafka_bootstrap, gateway, tasks, "--run", run_id, "--eval-id", run_id,
                   "--policy-version", str(POLICY_VERSION), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    printed = json.loads(out.stdout)
    assert printed["policy_version"] == POLICY_VERSION
    by_task = {o["task_id"]: o["reward"] for o in printed["outcomes"]}  # every episode's score, for paired tests
    assert by_task == {**{f"{run_id}-a{i}": 1.0 for i in range(4)},
                       **{f"{run_id}-r{i}": 1.0 if i < 2 else 0.0 for i in range(4)}}
    # the scripted engine calls the calculator (a parsed call of an offered tool), then answers: two turns a session
    assert printed["acting"]["all"] == {"sessions": 8, "tool_call_rate": 1.0, "valid_call_rate": 1.0,
                                        "mean_turns": 2.0}
    assert set(printed["acting"]) == {"agent", "reasoning", "all"}

    results = {r["domain"]: r for r in read_events(kafka_bootstrap, TOPICS.evals, lambda r: r["eval_id"] == run_id)}
    assert set(results) == {"agent", "reasoning", "all"}
    assert [(results[d]["episodes"], results[d]["failed"], results[d]["mean_reward"])
            for d in ("agent", "reasoning", "all")] == [(4, 0, 1.0), (4, 0, 0.5), (8, 0, 0.75)]
    for r in results.values():
        assert r["ci_low"] <= r["mean_reward"] <= r["ci_high"] and r["ci_high"] - r["ci_low"] > 0.1
        assert (r["run"], r["policy_version"], r["split"]) == (run_id, POLICY_VERSION, "heldout")

    started = read_events(kafka_bootstrap, TOPICS.sessions,
                          lambda r: r["task_id"].startswith(run_id) and "base_url" in r)
    assert len(started) == 8 and all(s["metadata"]["purpose"] == "eval" for s in started)
    assert not read_events(kafka_bootstrap, TOPICS.tasks, lambda r: r["task_id"].startswith(run_id))


def test_eval_refuses_another_policy_version(kafka_bootstrap, gateway, run_id, tmp_path):
    tasks = tmp_path / "heldout.jsonl"
    tasks.write_text(json.dumps({"task_id": f"{run_id}-x", "prompt": {"question": "?", "answer": "1"}}) + "\n")
    out = eval_cli(kafka_bootstrap, gateway, tasks, "--eval-id", run_id, "--policy-version", "99")
    assert out.returncode == 2 and "serves policy version [3], not 99" in out.stderr
    assert not read_events(kafka_bootstrap, TOPICS.sessions, lambda r: r["task_id"].startswith(run_id))
    assert not read_events(kafka_bootstrap, TOPICS.evals, lambda r: r["eval_id"] == run_id)
