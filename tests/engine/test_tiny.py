import hashlib
import json
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.tiny.model import SPECIAL_TOKENS, TOOL_TOKENS, TinyModelSpec, init_tiny_model


def _digest(path):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_writes_identical_files_in_hf_layout(tmp_path, tiny_model_dir):
    init_tiny_model(tmp_path / "again", TinyModelSpec(seed=0))
    assert _digest(tmp_path / "again") == _digest(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(_digest(tiny_model_dir))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]


def test_other_seed_other_weights_and_llama_arch(tmp_path, tiny_model_dir):
    summary = init_tiny_model(tmp_path / "llama", TinyModelSpec(arch="llama", seed=1))
    assert _digest(tmp_path / "llama")["model.safetensors"] != _digest(tiny_model_dir)["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 900 <= summary["vocab_size"] <= 4096  # a real BPE vocabulary (digits stay single tokens: fewer merges)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("What is 347 + 518?")]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("347518")  # one token per digit


def test_markup_tokens_are_single_tokens_and_survive_decode(tokenizer):
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text


def test_chat_template_renders_tools_calls_and_results(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_model_init_takes_a_width_and_depth_and_refuses_a_width_heads_cannot_split(tmp_path):
    out = tmp_path / "wide"
    done = subprocess.run([sys.executable, "-m", "forge_stream", "model", "init", "--out", str(out), "--hidden-size",
                           "256", "--layers", "3", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (256, 3, 512)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)  # heads of 32, as the default
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) == json.loads(done.stdout)["parameters"]

    bad = subprocess.run([sys.executable, "-m", "forge_stream", "model", "init", "--out", str(tmp_path / "bad"),
                          "--hidden-size", "100"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert "the hidden size is a multiple of 64" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "bad").exists()
