"""Helpers of the real-vLLM tests: the engine under test (push a policy version to it), checkpoints of other weights,
open a gateway session, and the trainer's own log-probs of recorded completions."""

from __future__ import annotations

import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

from forge_stream.tree.logprobs import sequence_logprobs
from forge_stream.tree.pack import pack


@dataclass
class VllmEngine:
    url: str
    run: str
    log: Path
    bootstrap: str
    pid: int | None = None  # the engine's front process (vLLM's processes are its descendants)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def push_version(self, checkpoint: Path, timeout: float = 120.0) -> int:
        """Publish the next policy version with `checkpoint` on forge.policy; returns it once the engine serves it."""
        version = self.health()["policy_version"] + 1
        producer = EventProducer(self.bootstrap)
        producer.send_sync(TOPICS.policy, self.run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": version, "step": version,
            "checkpoint_uri": str(checkpoint), "base_model": str(checkpoint)})
        producer.close()
        deadline = time.monotonic() + timeout
        while self.health()["policy_version"] != version:
            assert time.monotonic() < deadline, f"version {version} not served: {self.health()}; see {self.log}"
            time.sleep(0.2)
        return version


def vllm_socket(log: Path) -> Path:
    """vLLM's private Unix socket, as the engine's log names it when it starts vLLM."""
    return Path(re.search(r"starting vLLM \(.*?\) on unix socket (\S+): ", log.read_text()).group(1))


def perturbed_copy(base: Path, out: Path, seed: int, scale: float = 0.05) -> Path:
    """A checkpoint of `base`'s shapes and tokenizer with other weights (the next policy version)."""
    shutil.copytree(base, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(out)
    return out


def open_session(gateway: str, group_id: str) -> dict:
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": "task"}, timeout=30)
    assert response.status_code == 201, response.text
    return response.json()


def trainer_logprobs(model_dir, records: list[dict]) -> list[torch.Tensor]:
    """The trainer's log-probs (tree-packed forward pass) of each record's completion tokens given its prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sequences = [r["prompt_token_ids"] + r["completion_token_ids"] for r in records]
    with torch.no_grad():
        per_sequence = sequence_logprobs(model, pack(sequences))
    return [lp[len(r["prompt_token_ids"]) - 1:] for lp, r in zip(per_sequence, records)]
