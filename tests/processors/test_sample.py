"""The TrainSample builder on the prefix-tree packer: mask predicate, path recovery, per-row training data."""

from hypothesis import given, settings as hsettings, strategies as st

from forge_stream.processors.rewards import Rollout, Turn
from forge_stream.processors.sample import build_sample, sample_paths

HEADER = {"event_id": "e", "event_time": 0, "group_id": "g", "task_id": "t", "task_seq": 0, "domain": "qa",
          "group_complete": True}

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=6)
turn_spec = st.tuples(tokens, st.lists(st.integers(0, 3), min_size=1, max_size=4),
                      st.floats(-2, 2, allow_nan=False), st.booleans())


def make_turns(specs):
    turns = []
    for i, (prompt, completion, adv, ok) in enumerate(specs):
        comp = {"completion_id": f"c{i}", "session_id": f"s{i % 3}", "turn": i, "choice_index": 0, "trainable": ok,
                "prompt_token_ids": prompt, "completion_token_ids": completion, "policy_version": i % 4,
                "completion_logprobs": [-(i + 1) - j / 10 for j in range(len(completion))],
                "temperature": 0.5 + i, "top_p": 1.0 - i / 20, "logprobs_mode": "processed"}
        turns.append(Turn(comp, advantage=adv, reward=adv))
    return turns


def as_rollouts(turns):
    """One rollout per session, outcome = the session index."""
    sessions = sorted({t.completion["session_id"] for t in turns})
    return [Rollout(sid, sid, 0, [t for t in turns if t.completion["session_id"] == sid], outcome=float(sid[1:]))
            for sid in sessions]


@hsettings(max_examples=150, deadline=None)
@given(st.lists(turn_spec, min_size=1, max_size=7))
def test_sample_against_brute_force(specs):
    turns = make_turns(specs)
    sample = build_sample(as_rollouts(turns), HEADER)
    trained = sorted((t for t in turns if t.completion["trainable"]),
                     key=lambda t: (t.completion["session_id"], t.completion["turn"]))
    if not trained:
        assert sample is None
        return
    rows = sample["unique_tokens"]
    parent, end = sample["parent_row"], sample["subtree_end"]

    def ancestors(q):
        out = {q}
        while parent[q] >= 0:
            q = parent[q]
            out.add(q)
        return out

    for q in range(rows):
        anc = ancestors(q)
        assert sample["position_ids"][q] == len(anc) - 1
        for k in range(rows):
            assert (k <= q <= end[k]) == (k in anc)

    paths = sample_paths(sample)
    want_mask, want_lp, want_adv = [False] * rows, [None] * rows, [0.0] * rows
    for turn, seq, path in zip(trained, sample["sequences"], paths):
        comp = turn.completion
        full = comp["prompt_token_ids"] + comp["completion_token_ids"]
        assert [sample["token_ids"][r] for r in path] == full
        assert seq["completion_id"] == comp["completion_id"] and seq["length"] == len(full)
        assert seq["prompt_len"] == len(comp["prompt_token_ids"]) and seq["old_logprobs"] == comp["completion_logprobs"]
        assert (seq["rollout"], seq["outcome_reward"]) == (comp["session_id"], float(comp["session_id"][1:]))
        assert (seq["temperature"], seq["top_p"], seq["logprobs_mode"]) == (comp["temperature"], comp["top_p"],
                                                                             "processed")
        for row, lp in zip(path[seq["prompt_len"]:], comp["completion_logprobs"]):
            want_mask[row] = True
            want_lp[row] = lp if want_lp[row] is None else want_lp[row]
            want_adv[row] += turn.advantage
    assert sample["row_loss_mask"] == want_mask
    assert [lp for lp, m in zip(sample["row_old_logprob"], want_mask) if m] == [lp for lp in want_lp if lp is not None]
    assert sample["row_advantage"] == want_adv
    assert sample["total_tokens"] == sum(len(p) for p in paths)
    assert sample["unique_tokens"] == len(sample["token_ids"]) <= sample["total_tokens"]
    assert sample["policy_version"] == min(t.completion["policy_version"] for t in trained)


def test_shared_prefix_is_packed_once():
    turns = make_turns([([1, 2, 3], [4, 5], 1.0, True), ([1, 2, 3], [4, 6], -1.0, True)])
    sample = build_sample(as_rollouts(turns), HEADER)
    assert sample["total_tokens"] == 10 and sample["unique_tokens"] == 6
    assert sample["row_loss_mask"] == [False, False, False, True, True, True]
    assert sample["row_advantage"][3] == 0.0  # token 4 trains both sequences: +1 and -1
