"""LoRA training (`train --lora-rank`): only the adapter trains, a version is the adapter, a restart resumes it,
and the tree-packed log-probs run through the adapted layers."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge_stream import lora
from forge_stream.events import decode, encode
from forge_stream.processors.fold import fold
from forge_stream.processors.settings import ProcessorSettings
from forge_stream.processors.synthetic import group_events
from forge_stream.scheduler.consumer import Batch, SchedulerSettings, start_at_end
from forge_stream.trainer.service import PolicyTrainer, TrainerSettings, find_checkpoint
from forge_stream.trainer.step import StepConfig
from forge_stream.tree import pack
from forge_stream.tree.logprobs import sequence_logprobs


def _settings(model_dir, checkpoint_dir, run_id, rank=4) -> TrainerSettings:
    return TrainerSettings(bootstrap="unused:9092", base_model=model_dir, checkpoint_dir=checkpoint_dir,
                           scheduler=SchedulerSettings(bootstrap="unused:9092", run=run_id),
                           step=StepConfig(lr=3e-2), lora_rank=rank)


def _sample(run_id) -> dict:
    state, sample = None, None
    for schema, record in group_events(run_id, group_size=3, turns=2):
        state, emits = fold(state, schema, record, ProcessorSettings())
        sample = next((e.record for e in emits if e.schema == "TrainSample"), sample)
    return sample


def test_a_lora_step_trains_the_adapter_only_and_publishes_it_as_the_version(tiny_model_dir, tmp_path, run_id):
    trainer = PolicyTrainer(_settings(tiny_model_dir, tmp_path, run_id), resume_version=0)
    adapted = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapted and all("lora_" in name for name in adapted)
    assert not any("lm_head" in name or "embed" in name for name in adapted)  # the tied head is left whole
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for name, p in trainer.model.named_parameters() if name in adapted}
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}

    trainer.step(Batch([_sample(run_id)], [0], 0, 0))
    record = trainer.checkpoint()

    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= adapted
    folder = tmp_path / record["checkpoint_uri"].rsplit("/", 1)[-1]
    assert lora.is_adapter(folder) and not (folder / "model.safetensors").exists()
    assert lora.adapter_base(folder) == str(tiny_model_dir)
    adapter_bytes = (folder / "adapter_model.safetensors").stat().st_size
    assert record["lora_rank"] == 4 and record["size_bytes"] == adapter_bytes
    assert record["base_model"] == str(tiny_model_dir)
    assert adapter_bytes < sum(p.numel() for p in before.values()) * 4 / 10  # far below the model's fp32 bytes
    assert decode(encode("PolicyVersion", record))[1] == record
    print(f"adapter version: {adapter_bytes} bytes (rank 4, tiny model)")

    served = lora.load_policy(folder).eval()  # what an engine serves: the adapter merged into its base
    ids = torch.tensor([[3, 17, 99, 5, 42, 7]])
    with torch.no_grad():
        trainer.model.eval()
        assert torch.allclose(served(ids).logits, trainer.model(ids).logits, atol=1e-5)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        assert not torch.allclose(served(ids).logits, base(ids).logits, atol=1e-4)


def test_a_lora_trainer_resumes_from_its_last_adapter_version(tiny_model_dir, tmp_path, run_id):
    settings = _settings(tiny_model_dir, tmp_path, run_id)
    trainer = PolicyTrainer(settings, resume_version=0)
    sample = _sample(run_id)
    for version in range(2):
        trainer.step(Batch([sample], [0], version, 0))
        trainer.checkpoint()
    saved = find_checkpoint(tmp_path, 2)
    resumed = PolicyTrainer(settings, resume_version=2)
    assert resumed.saved == saved and resumed.policy_version == 2
    weights = dict(resumed.model.named_parameters())
    for name, p in trainer.model.named_parameters():
        assert torch.equal(weights[name], p), name
    assert {n for n, p in weights.items() if p.requires_grad} == {n for n, p in trainer.model.named_parameters()
                                                                  if p.requires_grad}
    state, original = resumed.optimizer.state_dict()["state"], trainer.optimizer.state_dict()["state"]
    assert state.keys() == original.keys() and all(torch.equal(state[k]["exp_avg"], original[k]["exp_avg"])
                                                   for k in state)
    resumed.step(Batch([sample], [0], 2, 0))  # and trains on
    record = resumed.checkpoint()
    assert record["version"] == 3 and lora.is_adapter(record["checkpoint_uri"])
    on_disk = load_file(f"{record['checkpoint_uri']}/adapter_model.safetensors")
    assert on_disk and all("lora_" in key for key in on_disk)


def test_tree_packed_logprobs_through_an_adapter_equal_separate_forward_passes(tiny_model_dir, tmp_path, run_id):
    trainer = PolicyTrainer(_settings(tiny_model_dir, tmp_path, run_id), resume_version=0)
    torch.manual_seed(0)
    with torch.no_grad():  # a non-zero adapter: B starts at zero
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    trainer.model.eval()
    sequences = [[5, 9, 13, 21, 8, 30], [5, 9, 13, 40, 2], [5, 9, 11]]  # a shared prefix: a real tree
    with torch.no_grad():
        packed = sequence_logprobs(trainer.model, pack(sequences))
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
        moved = False
        for seq, got in zip(sequences, packed):
            ids = torch.tensor([seq])
            expected = trainer.adapter(input_ids=ids).logits[0, :-1].log_softmax(-1)
            expected = expected.gather(-1, ids[0, 1:, None])[:, 0]
            assert torch.allclose(got, expected, atol=1e-5)
            plain = base(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            moved = moved or not torch.allclose(got, plain, atol=1e-3)
        assert moved  # the adapter is in the path, not bypassed


@pytest.mark.slow
@pytest.mark.kafka
def test_train_lora_rank_publishes_adapter_versions_the_engine_serves(kafka_bootstrap, tiny_model_dir, tmp_path,
                                                                      run_id):
    """`forge-stream train --lora-rank 2` end to end: adapter versions on forge.policy, followed by the torch
    engine, whose answers are the adapter's policy."""
    import httpx

    from forge_stream.engine.shared.process import EngineProcess
    from forge_stream.kafka.history import Slice, read_slice
    from forge_stream.topics import TOPICS

    from helpers import until
    from test_service import _cli, _publish_groups

    run = f"lora-{run_id}"
    start_at_end(SchedulerSettings(bootstrap=kafka_bootstrap, run=run))
    _publish_groups(kafka_bootstrap, run_id, 4)
    prompt = [5, 17, 99, 23]
    with EngineProcess(str(tiny_model_dir), extra_args=("--bootstrap-servers", kafka_bootstrap, "--policy-run", run,
                                                          "--checkpoint-dir", str(tmp_path)),
                       log_path=tmp_path / "engine.log") as engine:
        _cli("train", "--bootstrap-servers", kafka_bootstrap, "--run", run, "--model", str(tiny_model_dir),
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--steps", "2", "--batch-size", "2", "--wait-s", "2",
             "--lr", "1e-2", "--lora-rank", "2", timeout=120)
        until(lambda: httpx.get(f"{engine.url}/health").json()["policy_version"] == 2, 60, "version 2 not served")
        answer = httpx.post(f"{engine.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 4, "temperature": 1.0, "logprobs": 0, "return_token_ids": True},
            timeout=60).json()

    versions = [e.record for e in read_slice(kafka_bootstrap, TOPICS.policy, Slice()) if e.key == run]
    assert [v["version"] for v in versions] == [1, 2]
    assert all(v["lora_rank"] == 2 and v["base_model"] == str(tiny_model_dir) for v in versions)
    last = versions[-1]["checkpoint_uri"]
    assert lora.is_adapter(last) and versions[-1]["size_bytes"] == lora.weight_bytes(last) > 0
    assert answer["policy_version"] == 2
    choice = answer["choices"][0]
    ids = prompt + choice["token_ids"]
    with torch.no_grad():
        lp = lora.load_policy(last, merge=False).eval()(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(choice["token_ids"])]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
