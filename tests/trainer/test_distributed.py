"""The trainer on torch.distributed (gloo, CPU): two real ranks take the single-process step, and under
`forge-stream train --nproc 2` only rank 0 talks to Kafka."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_service import _cli, _committed, _publish_groups
from test_trainer_step import _sample

from forge_stream.kafka.history import Slice, read_slice
from forge_stream.scheduler.consumer import SchedulerSettings, start_at_end
from forge_stream.topics import TOPICS
from forge_stream.trainer.distributed import DataParallel, balance
from forge_stream.trainer.losses import Clip
from forge_stream.trainer.step import StepConfig, build_optimizer, train_step
from forge_stream.tree.reference import tiny_causal_lm

CONFIG = StepConfig(clip=Clip(None, 0.3), lr=1e-2, grad_clip=0.05, token_budget=14, chunk_rows=4)


def _batches():
    """Five steps: trees of different sizes (some sharing a prompt), a NaN advantage, one tree only, and a group
    without signal (every advantage 0: in the normalizer, run by no rank) among three with one."""
    prompt = [5, 9, 2, 7]
    trees = [
        _sample("g0", [prompt + [1, 2, 3], prompt + [1, 2, 4, 4], prompt + [8]], [4, 4, 4], [1.0, -0.5, -0.5], 3, 0),
        _sample("g1", [[6, 6, 1], [6, 6, 1], [6, 3, 3, 3, 3]], [2, 2, 1], [0.3, 0.3, -0.6], 2, 1),
        _sample("g2", [[4, 4, 4, 4, 4, 4, 4], [4, 4, 4, 9]], [3, 3], [0.7, -0.7], 4, 2),
        _sample("g3", [prompt + [3] * 12, prompt + [3] * 6 + [2] * 5, [8, 8]], [4, 4, 1], [0.9, 0.1, -1.0], 4, 3),
        _sample("g4", [[1, 2], [1, 3]], [1, 1], [0.5, -0.5], 4, 4),
    ]
    second = [_sample(f"h{i}", [[i + 1] * (3 + 2 * i), [i + 1] * 2 + [9] * i], [2, 2], [0.4, -0.4], 5, 10 + i)
              for i in range(4)]
    poisoned = [dict(s) for s in second]
    poisoned[3] = {**second[3], "sequences": [{**second[3]["sequences"][0], "advantage": float("nan")},
                                              *second[3]["sequences"][1:]]}
    idle = _sample("i0", [prompt + [6, 6, 6, 6, 6], prompt + [6, 1]], [4, 4], [0.0, 0.0], 4, 20)
    return [trees, second, poisoned, trees[3:4], [idle, trees[2], *second[:2]]]


def _steps(dtype, ranks=None):
    """Parameters and stats after each step of `_batches`, single-process or as one rank."""
    model = tiny_causal_lm("qwen2", dtype=dtype, seed=7)
    optimizer = build_optimizer(model, CONFIG)
    out = []
    for samples in _batches():
        stats = train_step(model, optimizer, samples, CONFIG, policy_version=5, ranks=ranks)
        out.append(({k: p.detach().clone() for k, p in model.named_parameters()}, stats.as_dict()))
    return out


def _rank(rank, world_size, init_file, out_dir, dtype):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.save(_steps(dtype, DataParallel(rank, world_size, torch.device("cpu"))), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_balance_spreads_unique_tokens_deterministically():
    sizes = [40, 7, 23, 23, 5, 11, 2]
    shares = balance(sizes, 2)
    assert sorted(i for s in shares for i in s) == list(range(7))
    loads = [sum(sizes[i] for i in s) for s in shares]
    assert abs(loads[0] - loads[1]) <= max(sizes[i] for s in shares for i in s) and max(loads) == 56
    assert balance(sizes, 2) == shares and all(s == sorted(s) for s in shares)


@pytest.mark.slow
def test_two_gloo_ranks_take_the_single_process_steps(tmp_path):
    """Parameters after each of 5 steps (the second with active grad clipping on summed gradients, the third
    skipped for a NaN on one rank's tree, the fourth with an idle rank, the fifth with a group without signal) equal
    the single-process run."""
    dtype = torch.float64  # float32 agrees within 1e-6 for three steps; Adam amplifies its rounding to ~1.2e-6 by the 4th
    single = _steps(dtype)
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(tmp_path), dtype), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert balance([len(s["token_ids"]) for s in _batches()[0]], 2)[1]  # both ranks trained trees
    for step, (params, stats) in enumerate(single):
        for rank in ranks:
            rank_params, rank_stats = rank[step]
            for name, p in params.items():
                assert float((rank_params[name] - p).abs().max()) <= 1e-6, (step, name)
            for key in ("loss", "grad_norm", "clip_fraction", "ratio_mean", "ratio_max", "mismatch_mean",
                        "mismatch_max", "mean_reward", "outcome_reward"):
                if stats[key] == stats[key]:
                    assert rank_stats[key] == pytest.approx(stats[key], rel=1e-5, abs=1e-7), (step, key)
            for key in ("loss_tokens", "total_tokens", "unique_tokens", "groups", "sequences",
                        "groups_without_signal"):
                assert rank_stats[key] == stats[key], (step, key)
    assert single[0][1]["grad_norm"] > CONFIG.grad_clip  # the clip is active
    assert single[2][1]["grad_norm"] != single[2][1]["grad_norm"] and ranks[1][2][1]["grad_norm"] != ranks[1][2][1][
        "grad_norm"]
    for rank in (single, *ranks):  # the poisoned step changed nothing on any rank
        assert all(torch.equal(rank[1][0][k], rank[2][0][k]) for k in rank[1][0])
    assert any(not torch.equal(single[0][0][k], single[1][0][k]) for k in single[0][0])
    assert [step[1]["groups_without_signal"] for step in single] == [0, 0, 0, 0, 1]


@pytest.mark.slow
def test_train_nproc_2_consumes_and_publishes_on_rank_0_only(kafka_bootstrap, tiny_model_dir, tmp_path, run_id):
    run = f"run-{run_id}"
    start_at_end(SchedulerSettings(bootstrap=kafka_bootstrap, run=run))
    groups = _publish_groups(kafka_bootstrap, run_id, 3)
    out = _cli("train", "--nproc", "2", "--bootstrap-servers", kafka_bootstrap, "--run", run, "--model",
               str(tiny_model_dir), "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "1", "--batch-size", "3",
               "--wait-s", "2", "--lr", "1e-3", timeout=180)
    assert out.stderr.count("step 0: policy v1") == 1, out.stderr[-3000:]  # one progress line: rank 0's
    assert "rank 1 of 2 follows rank 0" in out.stderr
    steps = [e.record for e in read_slice(kafka_bootstrap, TOPICS.train_metrics, Slice()) if e.key == run]
    assert len(steps) == 1 and sorted(steps[0]["group_ids"]) == sorted(groups)
    policies = [e.record for e in read_slice(kafka_bootstrap, TOPICS.policy, Slice()) if e.key == run]
    assert [p["version"] for p in policies] == [1]
    assert [p.name[:7] for p in (tmp_path / "ckpt").iterdir()] == ["v000001"]
    assert any(offset >= 0 for offset in _committed(kafka_bootstrap, f"scheduler:{run}").values())
