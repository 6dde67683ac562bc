"""Prompts recorded by reference: which earlier completion a prompt extends, and how to rebuild it whole.

An agent's prompt at turn k usually is its prompt at turn k-1, that turn's completion, and a few new messages.
Recording every prompt whole makes a session's bytes grow with the square of its turns, so the gateway records a
chat Completion whose prompt extends an earlier completion of its session (a *lane*: the last completion of one
agent and choice index) by reference:

    prompt_ref           the completion_id of the completion it extends (null: the prompt is recorded whole)
    prompt_ref_tokens    how many leading prompt ids are the reference's (its whole prompt ids + its completion ids)
    prompt_ref_messages  how many leading messages are the reference's (its whole prompt messages)
    prompt_token_ids     the ids after those
    messages_json        the messages after those (a JSON list)

so that, with `ref` rebuilt whole first (a chain of references ends at a completion recorded whole):

    prompt ids = (ref.prompt_token_ids + ref.completion_token_ids)[:prompt_ref_tokens] + prompt_token_ids
    messages   = ref.messages[:prompt_ref_messages] + messages

A prompt extends a lane when it starts with the lane's whole prompt; prompt_ref_tokens then also covers the
longest run of the lane's completion ids it repeats (a chat template may end an assistant turn with other ids
than the engine's EOS). A prompt that starts with no lane's whole prompt (context management truncated or
summarized the history, or a new sub-agent started) is recorded whole. The events stay plain Avro: a reader
without this module sees the appended part and the reference.

`resolve_prompt` rebuilds one completion from the completions it may reference; `whole_completions` rebuilds a
list of them (all of a session's completions, e.g. read from the topic from the session's start).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b

import orjson


class MissingReference(KeyError):
    """A completion's prompt_ref names a completion that is not at hand (or the chain of references is broken)."""


def message_digest(message_json: bytes) -> bytes:
    """What a lane remembers of one prompt message: a digest of its exact JSON."""
    return blake2b(message_json, digest_size=16).digest()


@dataclass(frozen=True)
class Lane:
    """The last recorded completion of one (agent, choice index) lane of a session, as the gateway keeps it."""

    completion_id: str
    prompt: list[int]  # its whole prompt ids (one list shared by the lanes of a request's n choices)
    completion: list[int]
    messages: tuple[bytes, ...]  # message_digest of each of its whole prompt's messages


def shared_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items `a` and `b` have in common.

    >>> shared_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def by_reference(record: dict, messages: Sequence[bytes], lanes: Iterable[Lane],
                 digests: Sequence[bytes] | None = None) -> dict:
    """`record` (a chat Completion with its prompt whole; `messages` the JSON of each of its messages, `digests`
    their message_digest when already at hand) recorded by reference to the lane whose ids it repeats longest, among
    the lanes whose whole prompt it starts with; the record itself when it extends none.

    >>> lane = Lane("c0", [1, 2], [3, 9], (message_digest(b'"a"'),))
    >>> r = by_reference({"prompt_token_ids": [1, 2, 3, 4], "messages_json": '["a","b"]'}, [b'"a"', b'"b"'], [lane])
    >>> r["prompt_ref"], r["prompt_ref_tokens"], r["prompt_token_ids"], r["prompt_ref_messages"], r["messages_json"]
    ('c0', 3, [4], 1, '["b"]')
    >>> by_reference({"prompt_token_ids": [1, 5], "messages_json": '["a"]'}, [b'"a"'], [lane])["prompt_token_ids"]
    [1, 5]
    """
    ids = record["prompt_token_ids"]
    best, shared = None, 0
    for lane in lanes:
        n = len(lane.prompt)
        if n == 0 or len(ids) < n or ids[:n] != lane.prompt:
            continue
        n += shared_prefix(lane.completion, ids[n:n + len(lane.completion)])
        if n > shared:
            best, shared = lane, n
    if best is None:
        return record
    kept = shared_prefix(best.messages, [message_digest(m) for m in messages] if digests is None else digests)
    return {**record, "prompt_ref": best.completion_id, "prompt_ref_tokens": shared, "prompt_token_ids": ids[shared:],
            "prompt_ref_messages": kept, "messages_json": (b"[" + b",".join(messages[kept:]) + b"]").decode()}


def resolve_prompt(completion: dict, by_id: dict[str, dict], cache: dict | None = None,
                   messages: bool = True) -> tuple[list[int], str | None]:
    """The exact prompt ids and messages JSON `completion` was given (messages None when not asked for).

    `by_id` holds the completions it may reference (completion_id -> record, as recorded); `cache` (shared across
    calls) keeps what was rebuilt, so rebuilding a whole session costs one pass. Raises MissingReference when a
    referenced completion is not in `by_id`.
    """
    cache = {} if cache is None else cache
    chain = []
    node = completion
    while node.get("prompt_ref") is not None and (node["completion_id"], messages) not in cache:
        chain.append(node)
        ref = by_id.get(node["prompt_ref"])
        if ref is None or len(chain) > len(by_id):
            raise MissingReference(f"completion {completion['completion_id']} extends {node['prompt_ref']}, "
                                   f"which is not at hand (read its session from the start)")
        node = ref
    key = (node["completion_id"], messages)
    if key not in cache:
        cache[key] = (node["prompt_token_ids"], orjson.loads(node["messages_json"]) if messages else None)
    ids, listed = cache[key]
    for child in reversed(chain):
        base = ids + node["completion_token_ids"]
        if child["prompt_ref_tokens"] > len(base):
            raise MissingReference(f"completion {child['completion_id']} takes {child['prompt_ref_tokens']} ids "
                                   f"from {node['completion_id']}, which has {len(base)}")
        ids = base[:child["prompt_ref_tokens"]] + child["prompt_token_ids"]
        if messages:
            listed = listed[:child["prompt_ref_messages"]] + orjson.loads(child["messages_json"])
        cache[(child["completion_id"], messages)] = (ids, listed)
        node = child
    if completion.get("prompt_ref") is None:
        return ids, completion["messages_json"] if messages else None
    return ids, orjson.dumps(listed).decode() if messages else None


def whole(completion: dict, ids: list[int], messages_json: str | None) -> dict:
    """`completion` with its prompt whole (no reference); with `messages_json` None only the ids are rebuilt (the
    processors need no messages) and messages_json stays as recorded."""
    out = {**completion, "prompt_token_ids": ids, "prompt_ref": None, "prompt_ref_tokens": 0,
           "prompt_ref_messages": 0}
    if messages_json is not None:
        out["messages_json"] = messages_json
    return out


def whole_completions(records: Iterable[dict], messages: bool = True) -> list[dict]:
    """The records with every prompt rebuilt whole, in their order; references are looked up among them."""
    records = list(records)
    by_id = {r["completion_id"]: r for r in records}
    cache: dict = {}
    return [whole(r, *resolve_prompt(r, by_id, cache, messages)) for r in records]


__all__ = ["Lane", "MissingReference", "by_reference", "message_digest", "resolve_prompt", "shared_prefix", "whole",
           "whole_completions"]
