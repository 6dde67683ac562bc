"""`forge-stream bench codec`: our Avro codec against JSON on realistic Completion events, side by side.

Each Completion carries 4,096 prompt token ids, 512 completion token ids and 512 logprobs. Both codecs encode and
decode the same records in the same run; the figures are events per second and bytes per event.

`session_bytes` measures what prompts by reference (forge_stream.events.prompts) save: the encoded Completions
of one agent session of many turns, each prompt recorded whole vs by reference to the previous turn.
"""

from __future__ import annotations

import json
import random
import time

from forge_stream.events import decode, encode, new_event_id
from forge_stream.events.prompts import Lane, by_reference, message_digest, whole_completions


def completion(rng: random.Random, prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "event_id": new_event_id(), "event_time": 1_764_000_000_000, "completion_id": new_event_id(),
        "session_id": new_event_id(), "group_id": new_event_id(), "task_id": "task-42", "turn": 3,
        "choice_index": 0, "request_id": new_event_id(), "model": "forge-tiny", "engine_id": "engine-0",
        "policy_version": 17,
        "prompt_token_ids": [rng.randrange(151_000) for _ in range(prompt_tokens)],
        "completion_token_ids": [rng.randrange(151_000) for _ in range(completion_tokens)],
        "completion_logprobs": [-rng.expovariate(2.0) for _ in range(completion_tokens)],
        "messages_json": json.dumps([{"role": "user", "content": "Fix the failing test in utils.py."}]),
        "tools_json": None, "output_text": "x" * 1500, "tool_calls_json": None, "finish_reason": "stop",
        "trainable": True, "untrainable_reason": None, "received_ms": 1_764_000_000_000,
        "first_token_ms": 1_764_000_000_050, "done_ms": 1_764_000_001_000, "agent": "main",
    }


def _measure(records: list[dict], enc, dec, seconds: float) -> dict:
    encoded = [enc(r) for r in records]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for r in records:
            enc(r)
        n += len(records)
    enc_s = n / (time.perf_counter() - start)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for b in encoded:
            dec(b)
        n += len(encoded)
    dec_s = n / (time.perf_counter() - start)
    return {"encode_events_per_s": round(enc_s, 1), "decode_events_per_s": round(dec_s, 1),
            "events_per_s": round(1 / (1 / enc_s + 1 / dec_s), 1),
            "bytes_per_event": round(sum(map(len, encoded)) / len(encoded), 1)}


def run(events: int = 200, seconds: float = 2.0, prompt_tokens: int = 4096, completion_tokens: int = 512,
        seed: int = 0) -> dict:
    rng = random.Random(seed)
    records = [completion(rng, prompt_tokens, completion_tokens) for _ in range(events)]
    assert all(decode(encode("Completion", r))[1]["prompt_token_ids"] == r["prompt_token_ids"] for r in records[:3])
    avro = _measure(records, lambda r: encode("Completion", r), decode, seconds)
    as_json = _measure(records, lambda r: json.dumps(r).encode(), json.loads, seconds)
    return {
        "benchmark": "codec", "event": "Completion", "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens, "avro": avro, "json": as_json,
        "avro_size_vs_json": round(avro["bytes_per_event"] / as_json["bytes_per_event"], 3),
        "avro_speed_vs_json": round(avro["events_per_s"] / as_json["events_per_s"], 3),
        "note": "events_per_s is a full encode+decode round trip per event",
    }


def session_bytes(turns: int = 50, system_tokens: int = 2000, completion_tokens: int = 300, result_tokens: int = 500,
                  seed: int = 0) -> dict:
    """Encoded Completion bytes of one session of `turns` turns, prompts whole vs by reference.

    Turn k's prompt is turn k-1's prompt and completion plus a tool result of `result_tokens` tokens (about four
    characters of message text per token); the references are chosen as the gateway chooses them, and the
    prompts rebuilt from them are checked against the whole ones.
    """
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        return "".join(rng.choice("abcdefgh ") for _ in range(4 * tokens))

    ids = [rng.randrange(151_000) for _ in range(system_tokens)]
    messages = [{"role": "system", "content": text(system_tokens)}]
    whole, referenced, lanes = [], [], {}
    for turn in range(turns):
        record = {**completion(rng, 0, completion_tokens), "turn": turn, "prompt_token_ids": list(ids),
                  "messages_json": json.dumps(messages, separators=(",", ":"))}
        parts = [json.dumps(m, separators=(",", ":")).encode() for m in messages]
        whole.append(record)
        referenced.append(by_reference(record, parts, lanes.values()))
        lanes[(record["agent"], 0)] = Lane(record["completion_id"], record["prompt_token_ids"],
                                           record["completion_token_ids"], tuple(map(message_digest, parts)))
        ids = ids + record["completion_token_ids"] + [rng.randrange(151_000) for _ in range(result_tokens)]
        messages = messages + [{"role": "assistant", "content": record["output_text"]},
                               {"role": "tool", "content": text(result_tokens)}]
    rebuilt = whole_completions(referenced)
    assert [(r["prompt_token_ids"], r["messages_json"]) for r in rebuilt] == [
        (r["prompt_token_ids"], r["messages_json"]) for r in whole]
    size = {name: sum(len(encode("Completion", r)) for r in records)
            for name, records in (("whole", whole), ("by_reference", referenced))}
    return {"turns": turns, "last_prompt_tokens": len(whole[-1]["prompt_token_ids"]),
            "bytes_whole": size["whole"], "bytes_by_reference": size["by_reference"],
            "largest_event_whole": max(len(encode("Completion", r)) for r in whole),
            "largest_event_by_reference": max(len(encode("Completion", r)) for r in referenced),
            "ratio": round(size["whole"] / size["by_reference"], 1)}
