"""A LoRA run's base model kept in memory (forge_stream.lora.ResidentBase): successive adapter versions on the one
base, rank changing between them and an unreadable one among them, give the vLLM front's probe reference (peft, not
merged) bit for bit as a fresh load from disk does; the base is read from disk once and never changed."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from forge_stream import lora
from forge_stream.engine.shared.probe import probe_ids
from forge_stream.engine.vllm_front.reference_probe import reference_logprobs
from forge_stream.engine.vllm_front.runtime import VllmRuntime
from forge_stream.engine.vllm_front.state import VllmEngineSettings

from helpers import adapter_version


def test_adapter_versions_on_a_resident_base_equal_a_fresh_load(tiny_model_dir, tmp_path):
    first = adapter_version(tiny_model_dir, tmp_path / "v1", seed=1, rank=4)
    second = adapter_version(tiny_model_dir, tmp_path / "v2", seed=2, rank=8)  # the config changes: rank 4 -> 8
    corrupt = adapter_version(tiny_model_dir, tmp_path / "v3", seed=3, rank=8)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    third = adapter_version(tiny_model_dir, tmp_path / "v4", seed=4, rank=2)
    ids = probe_ids(AutoModelForCausalLM.from_pretrained(tiny_model_dir).config.vocab_size)
    settings = VllmEngineSettings(str(tiny_model_dir), VllmRuntime(tmp_path, "cpu"), tmp_path)
    resident = lora.ResidentBase()

    seen = []
    for version in (first, second, third):
        served = reference_logprobs(str(version), ids, settings, resident)
        # a fresh base from disk, bit for bit
        assert torch.equal(served, reference_logprobs(str(version), ids, settings))
        seen.append(served)
        if version == first:
            with pytest.raises(ValueError):
                reference_logprobs(str(corrupt), ids, settings, resident)
    # each version's adapter moved them its own way
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    assert resident.loads == 2  # once, and once more after the unreadable adapter (peft may have half-adapted it)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with resident.adapted(first) as model, model.disable_adapter(), torch.no_grad():  # the base is as read from disk
        assert torch.equal(model(torch.tensor([ids])).logits, fresh(torch.tensor([ids])).logits)
