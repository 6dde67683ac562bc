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

A lane's memory stays small at any context length. A prompt of `PACKED_FROM` ids or more is kept as the SHA-256 of
its canonical JSON (orjson's, "[1,2,3", without the closing bracket) and that text's length: a new prompt starts
with it when its own JSON has the same digest up to that length and an id ends there (a comma or the closing
bracket follows). A 200K-token prompt's ids held whole as Python ints take about 9 MB; its digest takes a few
hundred bytes. A lane rebuilt from Kafka extends its reference's digest with the ids appended (`Lane.extended`), so
a session is rebuilt without rebuilding its prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from hashlib import blake2b, sha256

import orjson


class MissingReference(KeyError):
    """A completion's prompt_ref names a completion that is not at hand (or the chain of references is broken)."""


def message_digest(message_json: bytes) -> bytes:
    """What a lane remembers of one prompt message: a digest of its exact JSON."""
    return blake2b(message_json, digest_size=16).digest()


PACKED_FROM = 4096  # prompt ids: a lane whose prompt has this many keeps their digest, not the ids


def ids_json(ids: Sequence[int]) -> bytes:
    """The canonical JSON of prompt ids, whose prefixes a long lane's digest is taken of."""
    return orjson.dumps(ids if isinstance(ids, list) else list(ids))


class Lane:
    """The last recorded completion of one (agent, choice index) lane of a session, as the gateway keeps it: its
    prompt's ids whole when short, else their digest (see the module's doc); its completion's ids; the message_digest
    of each of its whole prompt's messages. `text`, when given, is `ids_json(prompt)` already made."""

    __slots__ = ("completion_id", "prompt_len", "prompt", "completion", "messages", "_text_len", "_state", "_digest")
    packed_from = PACKED_FROM  # (tests set it lower, to run every lane packed)

    def __init__(self, completion_id: str, prompt: list[int], completion: list[int], messages: tuple[bytes, ...],
                 text: bytes | None = None):
        self.completion_id, self.completion, self.messages = completion_id, completion, messages
        self.prompt_len = len(prompt)
        if self.prompt_len < Lane.packed_from:
            self.prompt, self._text_len, self._state, self._digest = prompt, 0, None, b""
        else:
            text = ids_json(prompt) if text is None else text
            self._pack(sha256(), 0, memoryview(text)[:-1])

    def _pack(self, state, length: int, more: bytes | memoryview) -> None:
        """Keep the digest of a prompt's JSON: `state` has taken its first `length` bytes, `more` are the rest."""
        state.update(more)
        self.prompt, self._state, self._text_len, self._digest = None, state, length + len(more), state.digest()

    def starts(self, ids: list[int], text: Callable[[], bytes], digests: dict[int, bytes]) -> bool:
        """Whether prompt `ids` starts with this lane's whole prompt. `text()` gives `ids_json(ids)`; `digests`
        keeps the digests of its prefixes taken so far (lanes of one request's choices share them)."""
        n = self.prompt_len
        if n == 0 or len(ids) < n:
            return False
        if self.prompt is not None:
            return ids[:n] == self.prompt
        whole, cut = text(), self._text_len
        if len(whole) <= cut or whole[cut] not in b",]":  # an id must end where this prompt's last one does
            return False
        if cut not in digests:
            digests[cut] = sha256(memoryview(whole)[:cut]).digest()
        return digests[cut] == self._digest

    def extended(self, completion_id: str, ref_tokens: int, appended: list[int], completion: list[int],
                 messages: tuple[bytes, ...]) -> Lane:
        """The lane of a completion whose prompt is this lane's first `ref_tokens` ids (its prompt's, then its
        completion's) followed by `appended`: a recorded reference, rebuilt without the ids whole."""
        n = self.prompt_len
        if ref_tokens > n + len(self.completion) or (self.prompt is None and ref_tokens < n):
            raise ValueError(f"it takes {ref_tokens} ids of a lane of {n} + {len(self.completion)}"
                             + ("" if self.prompt is not None else " (a long lane: at least its whole prompt)"))
        if self.prompt is not None:
            return Lane(completion_id, (self.prompt + self.completion)[:ref_tokens] + appended, completion, messages)
        more = self.completion[:ref_tokens - n] + appended
        lane = Lane(completion_id, [], completion, messages)
        lane.prompt_len = n + len(more)
        lane._pack(self._state.copy(), self._text_len, b"," + ids_json(more)[1:-1] if more else b"")
        return lane

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Lane):
            return NotImplemented
        return ((self.completion_id, self.prompt_len, self.prompt, self._digest, self.completion, self.messages)
                == (other.completion_id, other.prompt_len, other.prompt, other._digest, other.completion,
                    other.messages))

    def __repr__(self) -> str:
        prompt = self.prompt if self.prompt is not None else f"<{self.prompt_len} ids, sha256 {self._digest.hex()[:12]}>"
        return f"Lane({self.completion_id!r}, {prompt}, {self.completion!r}, {len(self.messages)} messages)"


class PromptTexts:
    """The ids_json of the long prompts (those a Lane keeps packed) of one request's choices, made once each (the
    choices of a request share one prompt list) for their references and their lanes; None for a short prompt."""

    def __init__(self):
        self._made: dict[int, tuple[list[int], bytes]] = {}

    def get(self, ids: list[int] | None) -> bytes | None:
        if ids is None or len(ids) < Lane.packed_from:
            return None
        made = self._made.get(id(ids))
        if made is None:
            made = self._made[id(ids)] = (ids, ids_json(ids))  # the list is kept: its id stays its own
        return made[1]


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
                 digests: Sequence[bytes] | None = None, text: bytes | None = None) -> dict:
    """`record` (a chat Completion with its prompt whole; `messages` the JSON of each of its messages, `digests`
    their message_digest when already at hand, `text` the ids_json of its prompt ids when already made) recorded by
    reference to the lane whose ids it repeats longest, among the lanes whose whole prompt it starts with; the record
    itself when it extends none.

    >>> lane = Lane("c0", [1, 2], [3, 9], (message_digest(b'"a"'),))
    >>> r = by_reference({"prompt_token_ids": [1, 2, 3, 4], "messages_json": '["a","b"]'}, [b'"a"', b'"b"'], [lane])
    >>> r["prompt_ref"], r["prompt_ref_tokens"], r["prompt_token_ids"], r["prompt_ref_messages"], r["messages_json"]
    ('c0', 3, [4], 1, '["b"]')
    >>> by_reference({"prompt_token_ids": [1, 5], "messages_json": '["a"]'}, [b'"a"'], [lane])["prompt_token_ids"]
    [1, 5]
    """
    ids = record["prompt_token_ids"]
    made = [text]

    def ids_text() -> bytes:
        if made[0] is None:
            made[0] = ids_json(ids)
        return made[0]

    best, shared, prefixes = None, 0, {}
    for lane in lanes:
        if not lane.starts(ids, ids_text, prefixes):
            continue
        n = lane.prompt_len
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


__all__ = ["Lane", "MissingReference", "PACKED_FROM", "PromptTexts", "by_reference", "ids_json", "message_digest",
           "resolve_prompt", "shared_prefix", "whole", "whole_completions"]
