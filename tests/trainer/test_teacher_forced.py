"""Teacher-forced scoring (forge_stream.trainer.teacher_forced, `forge-stream tasks probe`): a policy scored turn by
turn on ideal conversations."""


def test_the_teacher_conversation_is_scored_turn_by_turn(tiny_model_dir):
    """Each held-out task's ideal conversation is rendered and every assistant turn scored: a random model gets a
    whole turn right with a vanishing probability, and its worst tokens say where."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge_stream.trainer.teacher_forced import score_ideal_turns

    report = score_ideal_turns(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                               AutoTokenizer.from_pretrained(tiny_model_dir), n=12, seed=3)
    assert set(report["turns"]) == {"agent/0", "agent/1", "lookup/0", "lookup/1", "reasoning/0"}
    assert sum(t["turns"] for k, t in report["turns"].items() if k.endswith("/0")) == 12
    for turn in report["turns"].values():
        assert 0 <= turn["p_turn_right"] < 0.01
        assert 0 <= turn["other"]["argmax_right"] <= 1 and turn["other"]["tokens"] > 0
    assert report["turns"]["agent/0"]["digit"]["tokens"] >= 6  # the operands of each calculator call
    assert report["worst_tokens"] and report["worst_tokens"][0]["count"] >= report["worst_tokens"][-1]["count"]
    by_kind = score_ideal_turns(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                AutoTokenizer.from_pretrained(tiny_model_dir), n=30, seed=3, mix={"lookup": 1.0},
                                by_kind=True)
    keys = {k.split("/")[0] for k in by_kind["turns"]}
    assert len(keys) > 5 and all(k.startswith("lookup:") for k in keys)  # one row per key asked
    assert sum(t["turns"] for k, t in by_kind["turns"].items() if k.endswith("/0")) == 30
