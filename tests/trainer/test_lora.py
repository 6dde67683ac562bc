"""LoRA training (`train --lora-rank`): only the adapter trains, a version is the adapter, a restart resumes it,
and the tree-packed log-probs run through the adapted layers."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from forge_stream import lora
from forge_stream.events import decode, encode
from forge_stream.processors.fold import fold
from forge_stream.processors.settings import ProcessorSettings
from forge_stream.processors.synthetic import group_events
from forge_stream.scheduler.consumer import Batch, SchedulerSettings
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
