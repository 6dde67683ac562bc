"""`forge-stream model init`: write a tiny random-weight causal LM in the standard HuggingFace layout.

The directory holds a Qwen2- or Llama-style `config.json`, `model.safetensors`, `generation_config.json` and a
byte-level BPE tokenizer trained here on `corpus.corpus()` with a ChatML chat template that supports tools
(Hermes-style `<tool_call>{json}</tool_call>`). transformers, vLLM and our engine all load it. Everything is a
function of the seed: the same seed writes byte-identical weights and tokenizer.
"""

import json
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from forge_stream.tiny.corpus import corpus

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added (never split) but not "special": they must survive decode(skip_special_tokens=True) so the
# tool-call parser sees them, as in Qwen2.5's tokenizer.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


@dataclass(frozen=True)
class TinyModelSpec:
    """Sizes of the tiny model. head_dim = hidden_size / heads = 32, a size every attention backend takes."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    initializer_range: float = 0.1
    seed: int = 0

    @classmethod
    def sized(cls, hidden_size: int, num_layers: int, **fields) -> "TinyModelSpec":
        """A spec of this width and depth in the default's proportions: heads of 32, half as many KV heads, an MLP
        twice as wide.

        >>> TinyModelSpec.sized(256, 3).num_heads, TinyModelSpec.sized(256, 3).intermediate_size
        (8, 512)
        """
        if hidden_size < 64 or hidden_size % 64:
            raise ValueError(f"the hidden size is a multiple of 64 (heads of 32, half as many KV heads), "
                             f"not {hidden_size}")
        heads = hidden_size // 32
        return cls(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_layers=num_layers,
                   num_heads=heads, num_kv_heads=heads // 2, **fields)


def chat_template() -> str:
    """The ChatML chat template with tool calling shipped with the package."""
    return resources.files("forge_stream.tiny").joinpath("chat_template.jinja").read_text()


def train_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the shipped corpus and wrap it as a HuggingFace fast tokenizer."""
    tok = Tokenizer(models.BPE())
    # Digits are single tokens (as in Llama and Qwen2): a number copied from a question into a tool call, or from
    # a tool result into an answer, is then the same tokens wherever it stands.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=chat_template(),
        model_max_length=32768,
    )


def _config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast):
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        rms_norm_eps=1e-6,
        dtype="float32",
    )
    if spec.arch == "llama":
        return LlamaConfig(**common), LlamaForCausalLM
    return Qwen2Config(use_sliding_window=False, **common), Qwen2ForCausalLM


def portable_tokenizer_config(path: Path, template: str, **extra) -> None:
    """Name the generic fast-tokenizer class and inline the template, so transformers 4.x (vLLM) loads it too
    (`extra`: other keys to set)."""
    cfg = json.loads(path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=template, add_bos_token=False,
               add_eos_token=False, **extra)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def init_tiny_model(out: Path, spec: TinyModelSpec = TinyModelSpec()) -> dict:
    """Write the tiny model to `out`; returns a summary (path, arch, vocab, parameter count)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(spec.vocab_size, spec.seed)
    config, model_cls = _config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    portable_tokenizer_config(out / "tokenizer_config.json", tokenizer.chat_template, bos_token=None)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1]).save_pretrained(out)
    return {
        "path": str(out),
        "arch": spec.arch,
        "vocab_size": len(tokenizer),
        "parameters": sum(p.numel() for p in model.parameters()),
        "spec": asdict(spec),
    }
