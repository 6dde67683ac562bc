"""Task and TrainSample records for the consumer tests (the only fake: the producers upstream)."""

from forge_stream.events import deterministic_id, now_ms


def group_id(run: str, seq: int) -> str:
    return f"{run}-g{seq}"


def task(run: str, seq: int, event_time: int | None = None) -> dict:
    return {
        "event_id": deterministic_id("task", run, seq), "event_time": event_time or now_ms(),
        "task_id": f"t{seq}", "group_id": group_id(run, seq), "seq": seq,
        "domain": "agent" if seq % 2 else "reasoning", "grader": "exact", "group_size": 2,
        "prompt_json": "{}", "metadata": {"run": run},
    }


def sample(run: str, seq: int, policy_version: int = 0) -> dict:
    return {
        "event_id": deterministic_id("sample", run, seq), "event_time": now_ms(),
        "group_id": group_id(run, seq), "task_id": f"t{seq}", "task_seq": seq,
        "domain": "agent" if seq % 2 else "reasoning", "policy_version": policy_version,
        "policy_version_max": policy_version, "total_tokens": 6, "unique_tokens": 4,
        "token_ids": [1, 2, 3, 4], "position_ids": [0, 1, 2, 2], "subtree_end": [3, 3, 2, 3],
        "parent_row": [-1, 0, 1, 1], "row_loss_mask": [False, False, True, True],
        "row_old_logprob": [0.0, 0.0, -0.5, -0.7], "row_advantage": [0.0, 0.0, 1.0, -1.0],
        "sequences": [], "group_complete": True,
    }


def skipped(run: str, seq: int, reason: str = "no trainable completion in its 2 finished sessions (2 failed)") -> dict:
    """The GroupSkipped the processors publish for a group that closed without a sample."""
    return {
        "event_id": deterministic_id("group_skipped", run, seq), "event_time": now_ms(),
        "group_id": group_id(run, seq), "task_id": f"t{seq}", "task_seq": seq, "reason": reason,
        "group_complete": True, "missing_sessions": [],
    }
