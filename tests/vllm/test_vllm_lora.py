"""LoRA versions reach real vLLM (`engine vllm --lora-rank`): each adapter is loaded at run time, proven with the
log-prob probe against peft, and served under the model name agents already use, each answer labelled with its
version; an adapter that cannot be read, or that vLLM refuses, is not announced and the last proven version stays
served; a version with the served adapter's bytes is announced without a load; an adapter is proven and served while
agents keep sampling (vLLM's CPU LoRA kernels cannot run the prompt log-probs of the full-weight probe beside other
requests: its worker died on the first adapter of a busy engine); versions that come faster than requests end keep
each retired adapter loaded, and its folder, until its last request ended (vLLM answers 404 for a request that
reaches it under a name already unloaded; it reads the folder again for a request that waited, and died when it had
gone: `bench learning --lora-rank 8` restarted the engine every few minutes).

vLLM runs here with LoRA on, which the package's other engine (conftest.vllm_engine) does not: one more start-up,
shared by this module's tests, in the background from the session's start (tests/early.py).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import uuid
from contextlib import contextmanager

import httpx
import pytest

from forge_stream import lora
from forge_stream.engine.shared.process import EngineProcess

from early import EARLY
from helpers import adapter_version, publish_adapter_version, until
from vllm_support import vllm_socket

pytestmark = pytest.mark.slow  # real vLLM

TOLERANCE = 1e-3  # nats: vLLM's fp32 CPU kernels against peft
MAX_BATCH = 4  # sequences vLLM decodes at once: more agents than this keep requests waiting in its queue


def _started(get):
    bootstrap, run = get("kafka_bootstrap"), f"vllm-lora-{uuid.uuid4().hex[:8]}"
    log = get("tmp_path_factory").mktemp("vllm-lora") / "engine.log"
    engine = EngineProcess(str(get("tiny_model_dir")), kind="vllm", log_path=log, extra_args=(
        "--served-model-name", "tiny-lora", "--bootstrap-servers", bootstrap, "--policy-run", run,
        "--lora-rank", "4", "--checkpoint-dir", str(get("tmp_path_factory").getbasetemp()),
        "--max-batch-size", str(MAX_BATCH)))
    return lambda: (engine.start(), run, log, bootstrap)


EARLY.declare("lora_engine", lambda item: "lora_engine" in item.fixturenames, _started,
              stop=lambda started: started[0].stop())


@pytest.fixture(scope="module")
def lora_engine(request):
    """Started in the background from the session's start (tests/early.py)."""
    started = EARLY.take("lora_engine", request.getfixturevalue)
    try:
        yield started
    finally:
        started[0].stop()


def _answer(url: str, prompt: list[int]) -> dict:
    body = {"model": "whatever-the-agent-says", "prompt": prompt, "max_tokens": 4, "temperature": 1.0,
            "logprobs": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@contextmanager
def _agents_sampling(url: str, body: dict, agents: int):
    """`agents` threads send `body` to the engine without pause until the block ends; yields the policy version of
    each answer and each error, as they come."""
    stop, served, errors = threading.Event(), [], []

    def agent() -> None:
        while not stop.is_set():
            try:
                response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
                response.raise_for_status()
                served.append(response.json()["policy_version"])
            except httpx.HTTPError as exc:
                errors.append(repr(exc))

    threads = [threading.Thread(target=agent) for _ in range(agents)]
    for thread in threads:
        thread.start()
    try:
        yield served, errors
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def _peft_logprobs(folder, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    model = lora.load_policy(folder, merge=False).eval()
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([prompt + completion])).logits[0].log_softmax(-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def test_adapter_versions_are_proven_served_under_the_agents_model_name_and_a_corrupt_one_is_refused(
        lora_engine, tiny_model_dir, tmp_path):
    engine, run, log, bootstrap = lora_engine
    good = adapter_version(tiny_model_dir, tmp_path / "v1", seed=1)
    corrupt = adapter_version(tiny_model_dir, tmp_path / "v2", seed=2)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated file
    later = adapter_version(tiny_model_dir, tmp_path / "v3", seed=3)
    too_big = adapter_version(tiny_model_dir, tmp_path / "v4", seed=4, rank=16)  # peft reads it; vLLM takes rank <= 8
    prompt = [5, 17, 99, 23, 42, 7, 300, 12]

    base = _answer(engine.url, prompt)
    published = publish_adapter_version(bootstrap, run, 1, good)
    first = until(lambda: (a := _answer(engine.url, prompt))["policy_version"] == 1 and a, 120,
                  lambda: f"version 1 not served; see {log}")
    took = time.monotonic() - published
    loaded = re.search(r"LoRA adapter (\S+) \((\d+) bytes\) loaded, probe log-probs within (\S+) of peft's; "
                       r"no request held; peft reference ([\d.]+)s, vLLM load ([\d.]+)s, vLLM probe ([\d.]+)s",
                       log.read_text())
    assert loaded, log.read_text()[-3000:]
    print(f"vLLM: adapter version 1 ({loaded.group(2)} bytes) published -> first answer under it in {took:.2f}s "
          f"(peft reference {loaded.group(4)}s beside load_lora_adapter {loaded.group(5)}s and the probe "
          f"{loaded.group(6)}s; within {loaded.group(3)} nats)")
    health = httpx.get(f"{engine.url}/health").json()
    assert health["probe_mismatch"] is not None and health["probe_mismatch"] < TOLERANCE
    assert health["switch_s"]["versions"] == 1 and 0 < health["switch_s"]["median"] < 120, health
    print(f"vLLM: the engine counts {health['switch_s']['median']:.2f}s from version 1's event_time to serving it")

    publish_adapter_version(bootstrap, run, 2, corrupt)
    until(lambda: f"policy version 2 at {corrupt} is not served" in log.read_text(), 120,
          "the corrupt version was not refused")
    kept = _answer(engine.url, prompt)
    assert httpx.get(f"{engine.url}/health").json()["policy_version"] == 1

    published = publish_adapter_version(bootstrap, run, 3, later)
    until(lambda: _answer(engine.url, prompt)["policy_version"] == 3, 120, lambda: f"version 3 not served; see {log}")
    print(f"vLLM: adapter version 3 published -> first answer under it in {time.monotonic() - published:.2f}s")
    publish_adapter_version(bootstrap, run, 4, too_big)
    until(lambda: f"policy version 4 at {too_big} is not served" in log.read_text(), 120,
          "the rank-16 version was not refused")
    refused = log.read_text().split(f"policy version 4 at {too_big} is not served", 1)[1].split("\n", 1)[0]
    assert "vLLM did not load it" in refused, refused
    after = _answer(engine.url, prompt)
    health = httpx.get(f"{engine.url}/health").json()
    unchanged = shutil.copytree(later, tmp_path / "v5")  # a step without signal: the same adapter bytes
    publish_adapter_version(bootstrap, run, 5, unchanged)
    until(lambda: httpx.get(f"{engine.url}/health").json()["policy_version"] == 5, 120, "version 5 not announced")
    renamed = httpx.get(f"{engine.url}/health").json()
    assert renamed["renamed_versions"] == health["renamed_versions"] + 1 and renamed["loads"] == health["loads"]
    assert renamed["lora_adapter"] == health["lora_adapter"] and health["lora_adapter"].startswith("policy-v3-")
    assert _answer(engine.url, prompt)["policy_version"] == 5
    listed = _vllm_models(log)

    assert base["policy_version"] == 0 and kept["policy_version"] == 1 and after["policy_version"] == 3
    # each answer was served by the adapter of the version it is labelled with
    for answer, folder in ((first, good), (kept, good), (after, later)):
        choice = answer["choices"][0]
        expected = _peft_logprobs(folder, prompt, choice["token_ids"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=TOLERANCE)
    plain = base["choices"][0]
    assert plain["logprobs"]["token_logprobs"] != pytest.approx(
        _peft_logprobs(good, prompt, plain["token_ids"]), abs=TOLERANCE)  # the adapter moved them
    assert sorted(listed) == sorted(["tiny-lora", next(n for n in listed if n.startswith("policy-v3-"))])


def test_an_adapter_is_proven_and_served_while_agents_keep_sampling(lora_engine, tiny_model_dir, tmp_path):
    engine, run, log, bootstrap = lora_engine
    version = adapter_version(tiny_model_dir, tmp_path / "v6", seed=6)
    prompt = [9, 31, 400, 77, 5, 18]
    pid = engine.pid
    body = {"model": "an-agent", "prompt": prompt, "max_tokens": 32, "temperature": 1.0}
    with _agents_sampling(engine.url, body, 4) as (served, errors):
        until(lambda: len(served) >= 8, 120, "the agents got no answers")
        logged = len(log.read_text())
        publish_adapter_version(bootstrap, run, 6, version)
        until(lambda: 6 in served, 180, lambda: f"version 6 not served; see {log}")
        answered = len(served)
        until(lambda: len(served) >= answered + 8, 120, "the engine stopped answering after the load")

    text = log.read_text()[logged:]  # since the publish (the rank-16 adapter above fails in vLLM's worker, as meant)
    assert errors == [] and engine.pid == pid, (errors[:3], text[-3000:])
    assert "WorkerProc hit an exception" not in text and "is not served" not in text
    assert httpx.get(f"{engine.url}/health").json()["probe_mismatch"] < TOLERANCE


def _held_adapters(engine) -> list[str]:
    """The version folders this engine holds (its holds folder in the cache directory, named with its pid)."""
    from forge_stream.settings import ForgeSettings

    return sorted(p.name for held in ForgeSettings().cache_dir.glob(f"engine-held-{engine.pid}-*")
                  for p in held.iterdir())


def test_versions_faster_than_requests_end_keep_each_adapter_until_its_last_request(
        lora_engine, tiny_model_dir, tmp_path):
    """Three times as many agents as vLLM decodes at once, with long answers, so requests of each version still wait
    in vLLM's queue after two more versions were switched in: every one is answered, by the same vLLM, and once they
    have all ended only the served version's folder is held."""
    engine, run, log, bootstrap = lora_engine
    versions = {v: adapter_version(tiny_model_dir, tmp_path / f"v{v}", seed=v) for v in range(7, 11)}
    prompt = [11, 2, 250, 61, 8, 140]
    pid = engine.pid
    body = {"model": "an-agent", "prompt": prompt, "max_tokens": 96, "min_tokens": 96, "temperature": 1.0}
    with _agents_sampling(engine.url, body, 3 * MAX_BATCH) as (served, errors):
        until(lambda: len(served) >= MAX_BATCH, 180, "the agents got no answers")
        logged = len(log.read_text())
        for version, folder in versions.items():
            publish_adapter_version(bootstrap, run, version, folder)
            until(lambda: httpx.get(f"{engine.url}/health").json()["policy_version"] == version, 180,
                  lambda: f"version {version} not served; see {log}")
        answered = len(served)
        until(lambda: len(served) >= answered + MAX_BATCH, 180, "the engine stopped answering after the loads")

    text = log.read_text()[logged:]
    assert errors == [] and engine.pid == pid, (errors[:3], text[-3000:])
    assert "No adapter found" not in text and "EngineDeadError" not in text, text[-3000:]
    assert set(versions) & set(served), f"no answer under the new versions: {sorted(set(served))}"
    health = httpx.get(f"{engine.url}/health").json()
    assert health["policy_version"] == 10 and health["lora_adapter"].startswith("policy-v10-")
    # each retired adapter is unloaded, and its folder removed, as its last request ends
    until(lambda: len(_held_adapters(engine)) == 1 and len(_vllm_models(log)) == 2, 30,
          lambda: f"retired adapters left behind: {_held_adapters(engine)}, {_vllm_models(log)}")
    assert _held_adapters(engine)[0].startswith("v000010-")
    assert sorted(_vllm_models(log)) == sorted(["tiny-lora", health["lora_adapter"]])


def _vllm_models(log) -> list[str]:
    """The model names vLLM itself knows: its base model and the LoRA adapters loaded and not yet unloaded."""
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(vllm_socket(log)))) as vllm:
        return [m["id"] for m in vllm.get("http://vllm/v1/models").json()["data"]]


def test_a_retired_adapter_is_unloaded_only_once_its_last_request_has_ended(lora_engine, tiny_model_dir, tmp_path):
    """A request the front sent under an adapter may not have reached vLLM's server when the next version is
    switched in, and vLLM answers 404 for a name already unloaded (CI saw an agent's request fail so): the retired
    adapter stays loaded while a request sent under it is in flight, and goes when it ends."""
    engine, run, log, bootstrap = lora_engine
    first, second = (adapter_version(tiny_model_dir, tmp_path / f"v{v}", seed=v) for v in (11, 12))
    publish_adapter_version(bootstrap, run, 11, first)
    until(lambda: httpx.get(f"{engine.url}/health").json()["policy_version"] == 11, 180, "version 11 not served")
    retiring = httpx.get(f"{engine.url}/health").json()["lora_adapter"]
    # 8 sequences of 1,000 tokens, 4 decoded at once: long enough to span the next version's load and proof
    body = {"model": "an-agent", "prompt": [3, 14, 159, 26, 5], "n": 2 * MAX_BATCH, "max_tokens": 1000,
            "min_tokens": 1000, "temperature": 1.0}
    answer = {}
    request = threading.Thread(target=lambda: answer.update(
        response=httpx.post(f"{engine.url}/v1/completions", json=body, timeout=600)))
    request.start()
    until(lambda: httpx.get(f"{engine.url}/health").json()["in_flight"] == 1, 30, "the request did not enter")
    publish_adapter_version(bootstrap, run, 12, second)
    until(lambda: httpx.get(f"{engine.url}/health").json()["policy_version"] == 12, 180, "version 12 not served")
    listed, held = _vllm_models(log), _held_adapters(engine)
    assert request.is_alive(), "the request ended before version 12 was served: make it longer"
    request.join()

    response = answer["response"]
    assert response.status_code == 200 and response.json()["policy_version"] == 11, response.text[:300]
    assert retiring in listed and len(held) == 2, (listed, held)  # kept while its request ran
    until(lambda: retiring not in _vllm_models(log) and len(_held_adapters(engine)) == 1, 30,
          lambda: f"the retired adapter was not unloaded after its last request: {_vllm_models(log)}")
    assert _held_adapters(engine)[0].startswith("v000012-")
