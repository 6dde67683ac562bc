"""`forge-stream bench learning`: it refuses RL from a warm start outside the band (saying why and what to do), pairs
each seed's two evaluations on the same test tasks, and runs several seeds end to end with tiny budgets."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge_stream.bench import cpu, learning, learning_result
from forge_stream.bench.intervals import tasks_for_half_width
from forge_stream.bench.learning_settings import LearningSettings
from forge_stream.cli import app
from forge_stream.rollout.sources import load_task_source
from forge_stream.tasks.suite import make_tasks, parse_mix, task_kind, template_key

REPO = Path(__file__).resolve().parents[2]
SINGLE_RUN_KEYS = {"baseline_reward", "final_reward", "improvement", "improvement_ci95", "steps", "groups_trained",
                   "rl_minutes", "mismatch_mean", "loss", "staleness_mean", "staleness_max",
                   "improvement_ci95_by_template", "test_templates"}


def warm(predicted: float) -> dict:
    return {"steps": 2000, "max_steps": 2000, "target": 0.2, "reached": predicted >= 0.2,
            "predicted_reward": predicted, "heldout_nll": 0.4, "heldout_examples": 128, "examples": 600,
            "final_loss": 0.33, "seconds": 1.0}


def evaluation(scores: dict[str, float]) -> dict:
    mean = sum(scores.values()) / len(scores)
    return {"domains": [{"domain": "all", "mean": mean, "low": mean - 0.1, "high": mean + 0.1,
                         "episodes": len(scores)}],
            "outcomes": [{"task_id": t, "domain": "agent", "ok": True, "reward": r} for t, r in scores.items()]}


def test_refuses_rl_from_a_warm_start_below_the_band(monkeypatch, tmp_path):
    """Seed 1's warm start misses the band: nothing is run (not even seed 0's RL), exit status 3, one line on
    stderr with the reason and the way out, and the JSON names it in `refused`."""
    monkeypatch.setattr(learning, "warm_start", lambda s, seed, home, progress: warm(0.3 if seed == 0 else 0.02))
    monkeypatch.setattr(learning, "run_seed", lambda *a, **k: pytest.fail("RL started from a warm start outside"))
    result = CliRunner().invoke(app, ["bench", "learning", "--seeds", "2", "--home", str(tmp_path), "--json"])
    assert result.exit_code == 3, result.output
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed["seed"] == 1 and printed["band"] == [0.1, 0.5] and printed["warm_start"]["predicted_reward"] == 0.02
    assert "0.020 is outside the band [0.10, 0.50]" in printed["refused"]
    [line] = [line for line in result.stderr.splitlines() if line.startswith("refusing to start RL")]
    assert "--sft-max-steps" in line and "--allow-outside-band" in line


def test_above_the_band_says_lower_the_target():
    reason = learning.check_band("seed 0's warm start: test reward", 0.62, (0.1, 0.5))
    assert "0.620 is outside the band" in reason and "lower --sft-target" in reason
    assert learning.check_band("x", 0.1, (0.1, 0.5)) is None and learning.check_band("x", 0.5, (0.1, 0.5)) is None


def test_allow_outside_band_runs_every_seed_and_summarizes(monkeypatch, tmp_path):
    """With --allow-outside-band the run goes on; the summary is the mean over seeds with a paired interval."""
    monkeypatch.setattr(learning, "warm_start", lambda s, seed, home, progress: warm(0.02))
    tasks = [f"test-0-{i}" for i in range(40)]

    def run_seed(s, seed, home, warm_start, progress):
        before = {t: float(i % 4 == 0) for i, t in enumerate(tasks)}
        after = {t: float(i % 4 == 0 or i % 4 == seed + 1) for i, t in enumerate(tasks)}
        return learning_result.seed_result(s, seed, warm_start, evaluation(before), evaluation(after),
                                 [], 15.0 + seed, 7)

    monkeypatch.setattr(learning, "run_seed", run_seed)
    result = CliRunner().invoke(app, ["bench", "learning", "--seeds", "2", "--allow-outside-band",
                                      "--home", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r["seed"] for r in out["seeds"]] == [0, 1] and out["test_tasks"] == 40 and out["rl_minutes"] == 16.0
    assert out["improvement"] == pytest.approx(0.25) and out["baseline_reward"] == pytest.approx(0.25)
    low, high = out["improvement_ci95"]
    assert 0.1 < low < 0.25 < high < 0.4
    assert all(SINGLE_RUN_KEYS <= set(r) for r in out["seeds"])
    # the same scores resampled by template: these are the suite's first test tasks, so their templates are known
    specs = {t.task_id: t for t in itertools.islice(load_task_source("suite:test"), 40)}
    assert out["test_templates"] == len({template_key(specs[t].domain, specs[t].graded)
                                         for t in tasks}) < 40
    low, high = out["improvement_ci95_by_template"]
    assert low < 0.25 < high and "by template" in out["interval"]
    assert out["footholds"]["won"] == sum(r["by_kind"]["won"] for r in out["seeds"])


def test_by_kind_counts_the_footholds_rl_won_and_lost():
    """Three kinds start with a foothold (about 0.3): RL takes one to 1.0, loses one to 0.0 and leaves one at about
    0.5; the rest start and end at 0 and are no footholds."""
    s = LearningSettings()
    ids = [t.task_id for t in itertools.islice(load_task_source(s.test_source), s.test_tasks)]
    kind = {t.task_id: task_kind(t.domain, t.graded) for t in itertools.islice(load_task_source(s.test_source), 600)}
    members: dict[str, list[str]] = {}
    for t in ids:
        members.setdefault(kind[t], []).append(t)
    won, lost, kept = [k for k, ts in members.items() if len(ts) >= 10][:3]
    before, after = dict.fromkeys(ids, 0.0), dict.fromkeys(ids, 0.0)
    for k, final in ((won, lambda i, n: 1.0), (lost, lambda i, n: 0.0), (kept, lambda i, n: float(i < n // 2))):
        n = len(members[k])
        for i, t in enumerate(members[k]):
            before[t], after[t] = float(i < round(0.3 * n)), final(i, n)
    result = learning_result.kinds(s, ids, [before[t] for t in ids], [after[t] for t in ids])
    assert (result["footholds"], result["won"], result["lost"]) == (3, 1, 1)
    assert result["kinds"][won]["final"] == 1.0 and 0.25 <= result["kinds"][lost]["baseline"] <= 0.35
    assert sum(v["tasks"] for v in result["kinds"].values()) == len(ids)
    # by chance a kind of 10 or more tasks solved at 0.3 scores 0.8 or more less than once in 600 draws, 0.2 or
    # less at most 0.38 of the time (less the more tasks it has)
    assert result["won_by_chance"] < 0.01 and 0.05 < result["lost_by_chance"] < 3 * 0.38
    start = result["by_start"]
    assert start["foothold"]["tasks"] == sum(len(members[k]) for k in (won, lost, kept))
    assert start["below"]["tasks"] + start["foothold"]["tasks"] == len(ids) and start["above"]["tasks"] == 0
    assert start["below"]["final"] == 0.0 and start["foothold"]["baseline"] == pytest.approx(0.3, abs=0.03)
    line = learning_result.describe_kinds(result)
    assert "of 3 such kinds RL took 1 to 0.8 or more" in line and "no kind it mostly could" in line
    assert learning_result.kinds(s, ["not-a-suite-task"], [0.0], [1.0]) is None


def test_a_pretrained_model_starts_without_sft_on_vllm_and_its_own_family(monkeypatch, tmp_path):
    """--model: no tiny model and no SFT (its band is checked on the test evaluation, in run_seed), the engine is vLLM
    and the tasks, training and test, are the pretrained mix's (times and copy), sampled at temperature 0.7, unless told
    otherwise."""
    seen = {}

    def run_seed(s, seed, home, warm_start, progress):
        seen.update(settings=s, warm=warm_start)
        return learning_result.seed_result(s, seed, warm_start, evaluation({"t": 0.0}), evaluation({"t": 1.0}), [], 1.0, 1)

    monkeypatch.setattr(learning, "run_seed", run_seed)
    monkeypatch.setattr(learning, "_cli", lambda *a, **k: pytest.fail(f"SFT or init ran: {a}"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["bench", "learning", "--model", str(model), "--home", str(tmp_path / "h"),
                                      "--json"])
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.engine, s.mix, s.temperature) == ("vllm", "times=1,copy=1", 0.7)
    assert s.test_source == "suite:test?mix=times=1,copy=1&temperature=0.7"
    assert s.training_source(2) == "suite:train?seed=2&mix=times=1,copy=1&temperature=0.7"
    tasks = list(itertools.islice(load_task_source(s.test_source), 20))
    assert {t.domain for t in tasks} == {"times", "copy"} and {t.prompt["temperature"] for t in tasks} == {0.7}
    assert (s.lr, s.updates_per_batch, s.engine_load_interval) == (1e-5, 1, 30.0)
    assert (s.rl_minutes, s.batch_size, s.test_tasks) == (10.0, 4, 400)  # the settings chosen on validation
    assert seen["warm"] == {"pretrained": str(model), "model_dir": str(model)}
    assert LearningSettings().test_source == "suite:test"  # the tiny model's: whatever the mix
    assert LearningSettings(temperature=0.5).test_source == "suite:test?temperature=0.5"
    result = CliRunner().invoke(app, ["bench", "learning", "--model", str(model), "--engine", "torch",
                                      "--home", str(tmp_path / "h2"), "--json"])
    assert result.exit_code == 0, result.output
    assert seen["settings"].engine_load_interval == 0.0  # the torch engine loads each version in a fraction of a second


def test_a_pretrained_model_with_warm_start_sft_is_fine_tuned_on_the_mix_first(monkeypatch, tmp_path):
    """--model --warm-start sft --mix tools: SFT of the pretrained model itself on the acting families'
    demonstrations (at a pretrained model's learning rate), RL from what it saved, and RL's stream past the tasks it
    was shown; the test evaluation is of the acting families too."""
    seen, calls = {}, []

    def run_seed(s, seed, home, warm_start, progress):
        seen.update(settings=s, warm=warm_start)
        return learning_result.seed_result(s, seed, warm_start, evaluation({"t": 0.0}), evaluation({"t": 1.0}), [], 1.0, 1)

    def cli(*args, env):
        calls.append(args)
        return {**warm(0.25), "by_family": {"calc": 0.3, "table": 0.2}, "curve": [], "family_target": 0.01,
                "balanced": True}

    monkeypatch.setattr(learning, "run_seed", run_seed)
    monkeypatch.setattr(learning, "_cli", cli)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["bench", "learning", "--model", str(model), "--warm-start", "sft", "--mix",
                                      "tools", "--home", str(tmp_path / "h"), "--json"])
    assert result.exit_code == 0, result.output
    [sft] = calls
    options = {name: sft[i + 1] for i, name in enumerate(sft[:-1]) if name.startswith("--") and name != "--balanced"}
    assert sft[0] == "sft" and options["--model"] == str(model) and options["--mix"] == "tools"
    assert (options["--lr"], options["--batch-size"], options["--check-every"]) == ("1e-05", "8", "1")
    assert (options["--target"], options["--family-target"]) == ("0.02", "0.01")
    s = seen["settings"]
    assert seen["warm"]["model_dir"] == str(tmp_path / "h" / "seed0" / "warm") and seen["warm"]["pretrained"]
    assert s.training_source(0) == "suite:train?seed=0&mix=tools&skip=600&temperature=0.7"
    assert {t.domain for t in itertools.islice(load_task_source(s.test_source), 20)} == {"calc", "table"}
    refused = CliRunner().invoke(app, ["bench", "learning", "--warm-start", "none"])
    assert refused.exit_code == 2 and "--warm-start" in refused.output


def test_warm_from_starts_each_seed_from_an_earlier_runs_warm_start_and_runs_no_sft(monkeypatch, tmp_path):
    """--warm-from RESULT: each seed RL-trains from the model the earlier run's SFT made for that seed (two settings
    compared from one start); no SFT runs, and a result without the seed, or whose warm start is gone, is refused
    before anything starts, saying what to do."""
    seen, calls = {}, []

    def run_seed(s, seed, home, warm_start, progress):
        seen[seed] = warm_start
        return learning_result.seed_result(s, seed, warm_start, evaluation({"t": 0.0}), evaluation({"t": 1.0}), [], 1.0, 1)

    monkeypatch.setattr(learning, "run_seed", run_seed)
    monkeypatch.setattr(learning, "_cli", lambda *args, env: calls.append(args))
    earlier = tmp_path / "earlier.json"
    warm_dirs = {seed: tmp_path / "home" / f"seed{seed}" / "warm" for seed in (0, 1)}
    for path in warm_dirs.values():
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    runs = [{"seed": seed, "warm_start": {**warm(0.3), "model_dir": str(path)}} for seed, path in warm_dirs.items()]
    # seed 1 was refused for its band after seed 0's RL: the result names it, and its warm start, at the top
    earlier.write_text(json.dumps({"refused": "seed 1's warm start: ...", **runs[1], "seeds": runs[:1]}))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["bench", "learning", "--model", str(model), "--mix", "tools", "--home", str(tmp_path / "h"), "--json"]
    result = CliRunner().invoke(app, [*args, "--seeds", "2", "--warm-from", str(earlier)])
    assert result.exit_code == 0, result.output
    assert calls == []  # no SFT, no model init
    assert {seed: w["model_dir"] for seed, w in seen.items()} == {seed: str(p) for seed, p in warm_dirs.items()}
    assert seen[1]["reused_from"] == str(earlier) and seen[1]["predicted_reward"] == 0.3
    missing = CliRunner().invoke(app, [*args, "--seeds", "3", "--warm-from", str(earlier)])
    assert missing.exit_code == 2 and "has no seed 2 (its seeds: [0, 1])" in missing.output
    (warm_dirs[1] / "config.json").unlink()
    gone = CliRunner().invoke(app, [*args, "--seeds", "2", "--warm-from", str(earlier)])
    assert gone.exit_code == 2 and "seed 1's warm start" in gone.output and "--home" in gone.output
    not_a_result = CliRunner().invoke(app, [*args, "--warm-from", str(model / "config.json")])
    assert not_a_result.exit_code == 2 and "not the JSON of a bench learning run" in not_a_result.output


def test_the_rl_stream_starts_past_the_tasks_the_warm_start_was_shown():
    """SFT demonstrates the first `sft_examples` tasks of the seed's training stream (same seed and mix); RL's
    stream is that stream from the next task on, so none of its tasks is one the warm start memorized."""
    s = LearningSettings(sft_examples=50)
    for seed in (0, 3):
        shown = make_tasks("train", s.sft_examples, seed=seed, mix=parse_mix(s.mix))
        unskipped = list(itertools.islice(load_task_source(f"suite:train?seed={seed}&mix={s.mix}"), 60))
        assert [t.task_id for t in unskipped[:50]] == [t.task_id for t in shown]  # what a stream without skip trains
        trained = list(itertools.islice(load_task_source(s.training_source(seed)), 10))
        assert [t.task_id for t in trained] == [t.task_id for t in unskipped[50:60]]
        assert not {t.task_id for t in trained} & {t.task_id for t in shown}
    pretrained = LearningSettings(model="SmolLM2-135M-Instruct", mix="mental=1")
    assert "skip" not in pretrained.training_source(0)  # no warm start, nothing to skip
    with pytest.raises(ValueError, match="skip must be 0 or more"):
        next(iter(load_task_source("suite:train?skip=-1")))


def test_an_engine_that_stops_answering_is_a_clear_error_not_a_traceback(monkeypatch, tmp_path):
    """After RL the bench waits for the engine to serve the last version: an engine that does not answer (restarting,
    or gone) is waited for, then reported with its log; one that answers gives its version."""
    from fastapi import FastAPI
    from helpers import serving

    from forge_stream.kafka.broker import free_port

    assert learning._wait_served(f"http://127.0.0.1:{free_port()}", 3, timeout_s=1.5) is None
    health = FastAPI()
    health.get("/health")(lambda: {"policy_version": 3})
    with serving(health) as url:
        assert learning._wait_served(url, 3, timeout_s=5) == 3

    def gone(*args, **kwargs):
        raise learning.EngineGone("[seed 0] the engine at http://x did not answer for 120 s ...: read /h/engine.log")

    monkeypatch.setattr(learning, "warm_start", lambda s, seed, home, progress: warm(0.3))
    monkeypatch.setattr(learning, "run_seed", gone)
    result = CliRunner().invoke(app, ["bench", "learning", "--home", str(tmp_path), "--json"])
    assert result.exit_code == 1 and "error: [seed 0] the engine" in result.stderr and "engine.log" in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_failed_run_on_a_fresh_home_keeps_its_services_logs(monkeypatch, tmp_path):
    """Without --home the bench's home is removed at the end; after a failure its services' logs are copied out
    first, and the output says where."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def fails(s, seed, home, warm_start, progress):
        (home / "run").mkdir(parents=True)
        (home / "run" / "engine.log").write_text("EngineDeadError: the reason\n")
        raise learning.EngineGone(f"[seed {seed}] the engine did not answer")

    monkeypatch.setattr(learning, "warm_start", lambda s, seed, home, progress: warm(0.3))
    monkeypatch.setattr(learning, "run_seed", fails)
    result = CliRunner().invoke(app, ["bench", "learning", "--json"])
    assert result.exit_code == 1 and "error: [seed 0] the engine did not answer" in result.stderr, result.output
    assert not list(tmp_path.glob("forge-bench-learning-[!l]*"))  # the home is gone
    [kept] = tmp_path.glob("forge-bench-learning-logs-*")
    assert (kept / "seed0" / "run" / "engine.log").read_text() == "EngineDeadError: the reason\n"
    assert f"its services' logs are kept in {kept}" in result.output


def test_evaluations_on_different_tasks_are_no_pair():
    with pytest.raises(RuntimeError, match="different test tasks"):
        learning_result.paired_scores(evaluation({"a": 1.0, "b": 0.0}), evaluation({"a": 1.0, "c": 0.0}))
    tasks, before, after = learning_result.paired_scores(evaluation({"b": 0.0, "a": 1.0}), evaluation({"a": 0.0, "b": 1.0}))
    assert (tasks, before, after) == (["a", "b"], [1.0, 0.0], [0.0, 1.0])


def test_default_test_tasks_give_plus_minus_0_04():
    assert tasks_for_half_width(0.04) <= LearningSettings.test_tasks + 1
    assert tasks_for_half_width(0.035) > LearningSettings.test_tasks  # not far more than needed


def test_settings_are_chosen_on_validation_and_replay_reaches_the_controller(tmp_path):
    """--eval-split validation evaluates on the validation split (the test split stays untouched while choosing
    settings); --replay-edge goes to the bench's rollout controller; bad values are refused before anything runs."""
    from forge_stream.builders import controller_service
    from forge_stream.settings import ForgeSettings

    assert LearningSettings(eval_split="validation").test_source == "suite:validation"
    assert LearningSettings(eval_split="validation", model="m", mix="mental=1").test_source == \
        "suite:validation?mix=mental=1"
    with pytest.raises(ValueError, match="test or validation"):
        LearningSettings(eval_split="train")
    argv = controller_service(ForgeSettings(home=tmp_path), {"agent": "a", "replay_edge": 0.5}).argv
    assert argv[argv.index("--replay-edge") + 1] == "0.5"
    assert "--replay-edge" not in controller_service(ForgeSettings(home=tmp_path), {"agent": "a"}).argv
    assert learning.rules(LearningSettings(partial_credit=0.5)) == [f"{learning.PARTIAL_CREDIT_RULE}=0.5"]
    assert learning.rules(LearningSettings()) == []
    for bad, says in ((["--eval-split", "train"], "--eval-split takes test or validation"),
                      (["--replay-edge", "1"], "--replay-edge is a share"),
                      (["--hidden-size", "100"], "--hidden-size: the hidden size is a multiple of 64")):
        result = CliRunner().invoke(app, ["bench", "learning", *bad, "--home", str(tmp_path / "h")])
        assert result.exit_code == 2 and says in result.output, result.output


@pytest.mark.slow
def test_two_seeds_end_to_end_with_tiny_budgets(tmp_path):
    """The whole protocol, twice, with tiny budgets: every key of the result, both evaluations of a seed on the same
    test tasks (the same for both seeds), the seeds' own warm starts, and rl_minutes within the RL phase."""
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "forge_stream", "bench", "learning", "--seeds", "2", "--seed", "5",
                          "--rl-minutes", "0.25", "--test-tasks", "6", "--sft-max-steps", "10", "--sft-examples", "32",
                          "--allow-outside-band", "--batch-size", "2", "--group-size", "2", "--concurrency", "8",
                          "--replay-edge", "0.5", "--partial-credit", "0.5", "--home", str(tmp_path / "home"), "--json"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"improvement", "improvement_ci95", "rl_minutes", "loss", "test_tasks", "seeds", "baseline_reward",
            "final_reward", "improvement_ci95_by_template", "test_templates"} <= set(result)
    assert result["test_tasks"] == 6 and result["loss"] == "cispo" and [r["seed"] for r in result["seeds"]] == [5, 6]
    low, high = result["improvement_ci95"]
    assert -1.0 <= low <= high <= 1.0
    for run in result["seeds"]:
        assert SINGLE_RUN_KEYS <= set(run)
        pairs = run["per_task"]
        assert len(pairs["task_ids"]) == len(pairs["baseline"]) == len(pairs["final"]) == 6
        assert pairs["task_ids"] == result["seeds"][0]["per_task"]["task_ids"]
        assert all(t.startswith("test-") for t in pairs["task_ids"])
        assert run["baseline_reward"] == pytest.approx(sum(pairs["baseline"]) / 6)
        assert run["final_reward"] == pytest.approx(sum(pairs["final"]) / 6)
        assert run["warm_start"]["steps"] == 10 and not run["warm_start"]["reached"]
        assert 0 < run["rl_minutes"] < 3
        assert run["steps"] >= 1 and run["groups_trained"] >= 2  # the controller's sessions reached the gateway
        assert 0 <= run["groups_replayed"] < run["groups_submitted"] and run["groups_submitted"] >= 2
        assert 0 <= run["staleness_mean"] <= run["staleness_max"]
        assert run["service_restarts"] == {}, run["service_restarts"]  # no service died and came back meanwhile
        assert sum(v["tasks"] for v in run["by_kind"]["kinds"].values()) == 6  # the same tasks, by kind
    assert "[seed 6] [3/5] RL for 0.25 minutes" in out.stderr  # progress, per seed
    assert "[seed 6]   by kind of task:" in out.stderr
    assert (tmp_path / "home" / "seed5" / "warm" / "config.json").exists()


def test_cpu_is_counted_by_service_part_across_a_restart():
    """The JSON's rl_cpu_seconds_by_process: a service's own process, vLLM's processes by their titles, the rest as
    its children; a part whose count went down was restarted and counts from 0."""
    service = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "subprocess.Popen(['bash', '-c', 'exec -a VLLM::Worker sleep 60'])\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "sum(i * i for i in range(3_000_000))\n"  # some CPU of its own
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert service.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while len(parts := cpu.proc_tree_cpu(service.pid, cpu.processes())) < 3:
            assert time.monotonic() < deadline, parts
            time.sleep(0.05)
    finally:
        os.killpg(service.pid, signal.SIGKILL)
        service.wait()
    assert set(parts) == {"self", "VLLM::Worker", "children"} and parts["self"] > 0
    assert cpu.cpu_used({"engine": {"self": 10.0, "VLLM::Worker": 50.0}},
                             {"engine": {"self": 12.5, "VLLM::Worker": 4.0, "children": 1.0}}) == {
        "engine": {"self": 2.5, "VLLM::Worker": 4.0, "children": 1.0}}


def test_lora_rank_reaches_the_settings_with_its_lr_and_no_load_interval(monkeypatch, tmp_path):
    """--lora-rank: the trainer and the engine get it; LoRA's lr defaults to 10x full fine-tuning's, and vLLM loads
    every adapter version (a load holds no request, so no interval)."""
    seen = {}

    def run_seed(s, seed, home, warm_start, progress):
        seen.update(settings=s)
        return learning_result.seed_result(s, seed, warm_start, evaluation({"t": 0.0}), evaluation({"t": 1.0}), [],
                                           1.0, 1)

    monkeypatch.setattr(learning, "run_seed", run_seed)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    result = CliRunner().invoke(app, ["bench", "learning", "--model", str(model), "--home", str(tmp_path / "h"),
                                      "--lora-rank", "1", "--json"])
    assert result.exit_code == 0, result.output
    s = seen["settings"]
    assert (s.lora_rank, s.lr, s.engine_load_interval) == (1, pytest.approx(1e-4), 0.0)


def test_a_lora_seed_gives_the_trainer_and_a_vllm_engine_its_rank(monkeypatch, tmp_path):
    seen = {}

    class Started(Exception):
        pass

    def up(cfg, topology, echo):
        seen["topology"] = topology
        raise Started

    monkeypatch.setattr(learning, "up", up)
    s = learning.LearningSettings(engine="vllm", lora_rank=4, model=str(tmp_path))
    with pytest.raises(Started):
        learning.run_seed(s, 0, tmp_path / "home", {"model_dir": str(tmp_path)}, progress=lambda line: None)
    services = seen["topology"].options
    assert services["trainer"]["lora_rank"] == 4 and services["engine"]["lora_rank"] == 4
