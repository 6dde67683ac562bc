"""LoRA adapters as policy versions: which layers get one, how the trainer wraps a model, how a version folder is
recognized as an adapter and loaded back onto its base model (the trainer's restart, the torch engine, the vLLM
engine's reference log-probs), and the base model the vLLM front keeps in memory so that an adapter version's
reference costs the adapter, not the base (`ResidentBase`).

An adapter version is peft's layout: `adapter_config.json` (rank, alpha, the adapted layers, and
`base_model_name_or_path`, the base model directory the trainer started from) and `adapter_model.safetensors`. Every
linear layer of the decoder gets an adapter (q, k, v, o, gate, up, down for Llama and Qwen2), found by type; the LM
head and the embeddings never do: vLLM serves no LoRA on a tied LM head, and the tiny model and SmolLM2 tie it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"


def default_alpha(rank: int) -> float:
    """lora_alpha when none is given: 2 x rank, so the adapter's scale (alpha / rank) is 2 whatever the rank."""
    return 2.0 * rank


def target_modules(model: torch.nn.Module) -> list[str]:
    """The names (last part) of the model's linear layers that get an adapter: all but the LM head.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> target_modules(LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
    ...     num_attention_heads=2, num_key_value_heads=1, vocab_size=100, tie_word_embeddings=True)))
    ['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']
    """
    head = model.get_output_embeddings()
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module is not head}
    head_name = next((name for name, module in model.named_modules() if module is head), "")
    if head_name.rsplit(".", 1)[-1] in names:
        raise ValueError(f"a decoder layer has the LM head's name {head_name!r}: LoRA could not leave the head out")
    if not names:
        raise ValueError("the model has no linear layer besides its LM head to put a LoRA adapter on")
    return sorted(names)


def wrap(model: torch.nn.Module, rank: int, alpha: float | None = None):
    """`model` with a fresh LoRA adapter of `rank` on every linear layer but the head (a peft PeftModel); only the
    adapter's parameters require gradients. B starts at zero, so the wrapped model computes what `model` did."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else default_alpha(rank), lora_dropout=0.0,
                        target_modules=target_modules(model), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_adapter(path: str | Path) -> bool:
    """Whether a version folder holds a LoRA adapter (peft's layout) rather than full weights."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_base(path: str | Path) -> str:
    """The base model directory an adapter folder applies to (its adapter_config.json says)."""
    import json

    config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return base


def load_adapter(base: torch.nn.Module, path: str | Path, trainable: bool = False):
    """`base` with the adapter of folder `path` (a PeftModel); OSError or ValueError if it cannot be read."""
    from peft import PeftModel
    from safetensors import SafetensorError

    try:
        return PeftModel.from_pretrained(base, str(path), is_trainable=trainable)
    except SafetensorError as exc:  # a truncated or corrupt adapter_model.safetensors
        raise ValueError(f"the adapter in {path} cannot be read: {exc}") from exc
    except (KeyError, RuntimeError, TypeError) as exc:  # a config or tensors that do not fit the base
        raise ValueError(f"the adapter in {path} does not fit its base model: {exc}") from exc


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, merge: bool = True) -> torch.nn.Module:
    """A policy version's model for inference: full weights as they are, an adapter on its base model (merged into
    the base's weights unless `merge` is False: then the adapter runs as peft's separate low-rank path)."""
    from transformers import AutoModelForCausalLM

    if not is_adapter(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model = load_adapter(AutoModelForCausalLM.from_pretrained(adapter_base(path), dtype=dtype), path)
    return model.merge_and_unload() if merge else model


def weight_bytes(path: str | Path) -> int:
    """Bytes of the weight files an engine loads from a version folder (*.safetensors: full weights or adapter)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


class ResidentBase:
    """The base model of a LoRA run, loaded from disk once (the first adapter that names it, in `dtype` on the CPU,
    eval mode) and kept: each adapter version then costs its adapter's bytes, not the base's. The base is never
    changed: an adapter is injected for one use and taken out again. An adapter naming another base directory
    replaces it (loaded once again). Its memory is one copy of the base's weights.

    Thread-safe: one adapter at a time is on the base (callers run it off their event loop)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.path: str | None = None  # the base directory held (resolved), once loaded
        self.loads = 0  # times a base was read from disk
        self._model: torch.nn.Module | None = None
        self._lock = threading.Lock()

    def _base(self, adapter: str | Path) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        path = str(Path(adapter_base(adapter)).resolve())
        if path != self.path:
            self.path = self._model = None  # the old base goes before the new one comes
            self._model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).eval()
            self.path, self.loads = path, self.loads + 1
        return self._model

    @contextmanager
    def adapted(self, adapter: str | Path) -> Iterator[torch.nn.Module]:
        """The base with the adapter of folder `adapter` on it, not merged (a PeftModel, as `load_policy(...,
        merge=False)` gives, computing the same log-probs bit for bit), for the `with` block only; OSError or
        ValueError as `load_adapter`. The adapter's config is read each time, so its rank and layers may change."""
        with self._lock:
            base = self._base(adapter)
            try:
                model = load_adapter(base, adapter)
            except BaseException:
                self.path = self._model = None  # peft may have put layers on it before it failed: read it again
                raise
            try:
                yield model.eval()
            finally:
                model.unload()  # the LoRA layers out again, the base's own weights untouched
                if hasattr(self._model, "peft_config"):
                    del self._model.peft_config
