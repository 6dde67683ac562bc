"""Builders of TrainStep, EvalResult and Trajectory records for the analytics tests."""

from forge_stream.events import deterministic_id

T0 = 1_764_000_000_000


def train_step(run: str, step: int) -> dict:
    return {
        "event_id": deterministic_id("train_step", run, step), "event_time": T0 + step * 1000, "step": step,
        "policy_version": step, "loss": 1.0 / (step + 1), "mean_reward": 0.1 * step, "groups": 2, "sequences": 8,
        "total_tokens": 400, "unique_tokens": 100, "tree_ratio": 4.0, "tokens_per_s": 50.0 + step,
        "staleness_mean": 0.5, "staleness_max": 1, "grad_norm": 0.3, "lr": 1e-5, "group_ids": [f"g{step}"],
        "outcome_reward": 0.2 * step, "rollouts": 8, "mismatch_mean": 0.01, "mismatch_max": 0.02,
        "ratio_mean": 1.0, "ratio_max": 1.1, "clip_fraction": 0.05,
    }


def eval_result(run: str, version: int, domain: str, mean: float) -> dict:
    return {
        "event_id": deterministic_id("eval", run, version, domain), "event_time": T0 + version * 1000 + 500,
        "eval_id": f"{run}-e{version}", "run": run, "policy_version": version, "domain": domain,
        "split": "heldout", "episodes": 16, "failed": 1, "mean_reward": mean, "ci_low": mean - 0.1,
        "ci_high": mean + 0.1, "agent": "", "metadata": {},
    }


def trajectory(run: str, i: int) -> dict:
    turn = {"completion_id": f"c{i}", "turn": 0, "agent": "a", "prompt_tokens": 10, "completion_tokens": 100_003 + i,
            "trainable": True, "outcome_reward": 0.0, "process_reward": 0.0, "time_reward": 0.0, "reward": 0.25,
            "reward_to_go": 0.25, "advantage": 0.0}
    return {"event_id": f"{run}-traj-{i}", "event_time": T0 + i, "group_id": f"{run}-g{i}", "task_id": f"t{i}",
            "task_seq": i, "session_id": f"s{i}", "status": "ok", "outcome_reward": float(i % 2),
            "wall_time_ms": 1500, "turns": [turn, {**turn, "turn": 1}], "group_complete": True,
            "missing_sessions": []}
