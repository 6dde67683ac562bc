"""The TrainSample builder: a group's trainable completions packed into one prefix tree with per-row training data.

The trie itself is `forge_stream.tree.pack`. Each trainable turn (a completion with at least one completion
token) of each rollout is one sequence, prompt_token_ids + completion_token_ids, in (rollout, turn,
completion_id) order, so the rows are the same whatever order the events arrived in. A turn of a prefix that
several rollouts share is one sequence per rollout (the trie stores its tokens once), so a step trains exactly
what training each rollout on its own would. Each sequence names its rollout and carries the rollout's
outcome reward and the completion's sampling temperature, top_p and logprobs mode (what the trainer scores its tokens
at). Per row:
- row_loss_mask: the row is a completion token (at or past prompt_len on its path) of at least one sequence;
- row_old_logprob: that token's rollout log-prob, from the first sequence (in sequence order) that trains it;
- row_advantage: the sum of the advantages of the sequences that train the row.
"""

from __future__ import annotations

from forge_stream.processors.rewards import Rollout
from forge_stream.tree import pack


def trainable(completion: dict) -> bool:
    return bool(completion["trainable"]) and len(completion["completion_token_ids"]) > 0


def build_sample(rollouts: list[Rollout], header: dict) -> dict | None:
    """A TrainSample record (header: event_id, event_time, group_id, task_id, task_seq, domain, group_complete)
    for the rollouts' trainable turns, or None when there is none."""
    entries = sorted(((r, t) for r in rollouts for t in r.turns if trainable(t.completion)),
                     key=lambda e: (e[0].rollout_id, e[1].completion["turn"], e[1].completion["completion_id"]))
    turns = [t for _, t in entries]
    if not turns:
        return None
    tree = pack([t.completion["prompt_token_ids"] + t.completion["completion_token_ids"] for t in turns])
    rows = tree.num_rows
    mask = [False] * rows
    old_logprob = [0.0] * rows
    advantage = [0.0] * rows
    sequences = []
    for (rollout, turn), path, last in zip(entries, tree.paths, tree.last_row.tolist()):
        comp = turn.completion
        prompt_len = len(comp["prompt_token_ids"])
        for row, logprob in zip(path[prompt_len:].tolist(), comp["completion_logprobs"]):
            if not mask[row]:
                mask[row], old_logprob[row] = True, logprob
            advantage[row] += turn.advantage
        sequences.append({
            "completion_id": comp["completion_id"], "session_id": comp["session_id"], "turn": comp["turn"],
            "last_row": last, "length": int(path.numel()), "prompt_len": prompt_len,
            "old_logprobs": list(comp["completion_logprobs"]), "advantage": turn.advantage,
            "reward": turn.reward, "policy_version": comp["policy_version"], "rollout": rollout.rollout_id,
            "outcome_reward": rollout.outcome, "temperature": comp["temperature"], "top_p": comp["top_p"],
            "logprobs_mode": comp["logprobs_mode"],
        })
    versions = [t.completion["policy_version"] for t in turns]
    return {
        **header,
        "policy_version": min(versions), "policy_version_max": max(versions),
        "total_tokens": tree.total_tokens, "unique_tokens": rows,
        "token_ids": tree.token_ids.tolist(), "position_ids": tree.position_ids.tolist(),
        "subtree_end": tree.subtree_end.tolist(), "parent_row": tree.parent_row.tolist(),
        "row_loss_mask": mask, "row_old_logprob": old_logprob, "row_advantage": advantage,
        "sequences": sequences,
    }


def sample_paths(sample: dict) -> list[list[int]]:
    """Each sequence's rows, root first, walked up from its last_row through parent_row."""
    parent = sample["parent_row"]
    paths = []
    for seq in sample["sequences"]:
        path = [seq["last_row"]]
        while parent[path[-1]] >= 0:
            path.append(parent[path[-1]])
        paths.append(path[::-1])
    return paths


__all__ = ["build_sample", "sample_paths", "trainable"]
