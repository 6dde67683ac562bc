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

The gateway does not parse a long prompt's ids either: it keeps the engine's JSON text of them (`PromptIds`, when it
is in that compact form, as vLLM's is), checks a lane's digest against that text, and parses only what follows the
lane's prompt, the ids recorded by reference.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
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


def _compact(text: bytes) -> bool:
    """Whether `text` is an array of ids written as `ids_json` writes them (digits and commas between brackets),
    checked without parsing it. What a JSON encoder cannot have written (`[1,,2]`, `[01]`) passes here and fails
    where it is parsed: every part of a prompt's text is parsed once, when it is first recorded.

    >>> [_compact(t) for t in (b"[]", b"[0]", b"[1,20,3]", b"[1, 2]", b"[,1]", b"[1,]", b"[1.0]", b"[-1]", b"1")]
    [True, True, True, False, False, False, False, False, False]
    """
    if len(text) < 2 or text[0] != 91 or text[-1] != 93:  # [ ]
        return False
    body = text[1:-1]
    return not body or not (body.translate(None, b"0123456789,") or body[0] == 44 or body[-1] == 44)


class PromptIds:
    """One prompt's token ids, held as a list or as their JSON text as the engine sent them, each made from the
    other only when it is asked for. At 200K ids, parsing their text takes about 6 ms and the list 7 MB, while
    finding the lane a prompt extends and the ids it appends needs only the text: the part of it after the lane's
    prompt is all that gets parsed. `text` must be in `ids_json`'s form (`PromptIds.of_text` checks)."""

    __slots__ = ("_ids", "_text", "_count", "_heads")

    def __init__(self, ids: list[int] | None = None, text: bytes | None = None):
        self._ids, self._text, self._count, self._heads = ids, text, None, {}

    @staticmethod
    def of_text(text: bytes) -> PromptIds | None:
        """The prompt of a JSON array of ids, kept as text; None when it is not in `ids_json`'s form (parse it)."""
        return PromptIds(text=bytes(text)) if _compact(text) else None

    @staticmethod
    def of(value: PromptIds | Sequence[int] | None) -> PromptIds | None:
        if value is None or isinstance(value, PromptIds):
            return value
        return PromptIds(ids=value if isinstance(value, list) else list(value))

    def __len__(self) -> int:
        if self._count is None:
            self._count = (len(self._ids) if self._ids is not None
                           else self._text.count(b",") + 1 if len(self._text) > 2 else 0)
        return self._count

    def counted(self, n: int) -> None:
        """The prompt has `n` ids (known without counting them: a reference's ids and those appended)."""
        self._count = n

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = orjson.loads(self._text)
        return self._ids

    def text(self) -> bytes:
        if self._text is None:
            self._text = ids_json(self._ids)
        return self._text

    def after(self, n: int, cut: int) -> list[int]:
        """The ids after the first `n`, whose JSON ends `cut` bytes into `text()` (see `Lane.start_in`)."""
        if self._ids is not None:
            return self._ids[n:]
        return orjson.loads(b"[" + self._text[cut + 1:]) if self._text[cut] == 44 else []

    def head(self, cut: int):
        """The SHA-256 state of the first `cut` bytes of `text()` (taken once per cut)."""
        state = self._heads.get(cut)
        if state is None:
            state = self._heads[cut] = sha256(memoryview(self.text())[:cut])
        return state

    def packed(self) -> tuple[object, int]:
        """The SHA-256 state of `text()` without its closing bracket, and that length: the longest head taken so far
        extended by the rest, so the text is hashed once (the choices of a request share it)."""
        whole = len(self.text()) - 1
        if whole not in self._heads:
            start = max((cut for cut in self._heads if cut < whole), default=0)
            state = self._heads[start].copy() if start else sha256()
            state.update(memoryview(self._text)[start:whole])
            self._heads[whole] = state
        return self._heads[whole], whole


class Lane:
    """The last recorded completion of one (agent, choice index) lane of a session, as the gateway keeps it: its
    prompt's ids whole when short, else their digest (see the module's doc); its completion's ids; the message_digest
    of each of its whole prompt's messages. The lane keeps nothing of `prompt` (a PromptIds or a list) but those, and
    its completion's ids packed (8 bytes each: as Python ints, a 32K-token reasoning turn would hold 1.2 MB until the
    next turn)."""

    __slots__ = ("completion_id", "prompt_len", "prompt", "completion", "messages", "_text_len", "_state", "_digest")
    packed_from = PACKED_FROM  # (tests set it lower, to run every lane packed)

    def __init__(self, completion_id: str, prompt: PromptIds | list[int], completion: Sequence[int],
                 messages: tuple[bytes, ...]):
        self.completion_id, self.completion, self.messages = completion_id, array("q", completion), messages
        prompt = PromptIds.of(prompt)
        self.prompt_len = len(prompt)
        if self.prompt_len < Lane.packed_from:
            self.prompt, self._text_len, self._state, self._digest = prompt.ids(), 0, None, b""
        else:
            self._pack(*prompt.packed())

    def _pack(self, state, length: int) -> None:
        """Keep the digest of a prompt's JSON: `state` has taken its `length` bytes, all but the closing bracket."""
        self.prompt, self._state, self._text_len, self._digest = None, state, length, state.digest()

    def start_in(self, prompt: PromptIds) -> int | None:
        """Where this lane's whole prompt ends in `prompt`, when `prompt` starts with it: the length of its ids' JSON
        without the closing bracket, in `prompt.text()` (-1 when both are lists, compared as lists); None when
        `prompt` does not start with it. A prompt held as text is compared as text, whatever the lane's length."""
        n = self.prompt_len
        if n == 0:
            return None
        if self.prompt is not None and prompt._ids is not None:
            return -1 if prompt._ids[:n] == self.prompt and len(prompt._ids) >= n else None
        whole = prompt.text()
        if self.prompt is not None:
            mine = ids_json(self.prompt)
            cut = len(mine) - 1
            same = whole.startswith(mine[:cut])
        else:
            cut = self._text_len
            same = len(whole) > cut and prompt.head(cut).digest() == self._digest
        return cut if same and len(whole) > cut and whole[cut] in b",]" else None  # an id ends where ours does

    def extended(self, completion_id: str, ref_tokens: int, appended: list[int], completion: list[int],
                 messages: tuple[bytes, ...]) -> Lane:
        """The lane of a completion whose prompt is this lane's first `ref_tokens` ids (its prompt's, then its
        completion's) followed by `appended`: a recorded reference, rebuilt without the ids whole."""
        n = self.prompt_len
        if ref_tokens > n + len(self.completion) or (self.prompt is None and ref_tokens < n):
            raise ValueError(f"it takes {ref_tokens} ids of a lane of {n} + {len(self.completion)}"
                             + ("" if self.prompt is not None else " (a long lane: at least its whole prompt)"))
        if self.prompt is not None:
            return Lane(completion_id, (self.prompt + self.completion.tolist())[:ref_tokens] + appended, completion,
                        messages)
        more = self.completion[:ref_tokens - n].tolist() + appended
        lane = Lane(completion_id, [], completion, messages)
        lane.prompt_len = n + len(more)
        state, tail = self._state.copy(), b"," + ids_json(more)[1:-1] if more else b""
        state.update(tail)
        lane._pack(state, self._text_len + len(tail))
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


def prefix_breaks(completions: Sequence[dict]) -> list[int]:
    """For each completion of a rollout (in turn order, prompts whole): how many ids of the previous completion of
    the same agent (its prompt ids, then its completion ids) its prompt does not repeat; 0 when it extends that
    completion token for token, and for an agent's first turn.

    A break is a re-rendering the sampled tokens did not survive: a chat template that re-renders a tool call's
    arguments, strips a think block, or merges whitespace across turns; or a context manager that truncated or
    summarized the history. The tokens trained are each completion's own sampled ids, with the engine's log-probs,
    so a break costs sharing in the prefix tree, never the training signal's provenance; it is counted so a
    template that breaks every turn is seen.

    >>> a = {"agent": "", "prompt_token_ids": [1, 2], "completion_token_ids": [3, 4]}
    >>> b = {"agent": "", "prompt_token_ids": [1, 2, 3, 4, 5], "completion_token_ids": [6]}
    >>> c = {"agent": "", "prompt_token_ids": [1, 2, 3, 9, 5, 6, 7], "completion_token_ids": [8]}
    >>> prefix_breaks([a, b, c])
    [0, 0, 3]
    """
    last: dict[str, dict] = {}
    out = []
    for comp in completions:
        prev = last.get(comp.get("agent", ""))
        broken = 0
        if prev is not None:
            expected = list(prev["prompt_token_ids"]) + list(prev["completion_token_ids"])
            broken = len(expected) - shared_prefix(expected, comp["prompt_token_ids"])
        out.append(broken)
        last[comp.get("agent", "")] = comp
    return out


def _repeated(completion: array, after: list[int]) -> int:
    """How many of a lane's completion ids `after` (the ids after the lane's prompt) starts with: all of them, as a
    rule, compared at once.

    >>> _repeated(array("q", [3, 9]), [3, 9, 4]), _repeated(array("q", [3, 9]), [3, 4]), _repeated(array("q"), [1])
    (2, 1, 0)
    """
    head = after[:len(completion)]
    if len(head) == len(completion) and array("q", head) == completion:
        return len(completion)
    return shared_prefix(completion, head)


def by_reference(record: dict, messages: Sequence[bytes], lanes: Iterable[Lane],
                 digests: Sequence[bytes] | None = None, prompt: PromptIds | None = None) -> dict:
    """`record` (a chat Completion; `messages` the JSON of each of its messages, `digests` their message_digest when
    already at hand) with its prompt (`prompt`, else the record's prompt_token_ids) recorded by reference to the lane
    whose ids it repeats longest, among the lanes whose whole prompt it starts with; recorded whole when it extends
    none.

    >>> lane = Lane("c0", [1, 2], [3, 9], (message_digest(b'"a"'),))
    >>> r = by_reference({"prompt_token_ids": [1, 2, 3, 4], "messages_json": '["a","b"]'}, [b'"a"', b'"b"'], [lane])
    >>> r["prompt_ref"], r["prompt_ref_tokens"], r["prompt_token_ids"], r["prompt_ref_messages"], r["messages_json"]
    ('c0', 3, [4], 1, '["b"]')
    >>> by_reference({"prompt_token_ids": [1, 5], "messages_json": '["a"]'}, [b'"a"'], [lane])["prompt_token_ids"]
    [1, 5]
    >>> by_reference({"messages_json": '["a"]'}, [b'"a"'], [lane], None, PromptIds(text=b"[1,2,3,4]"))["prompt_ref"]
    'c0'
    """
    prompt = PromptIds(ids=record["prompt_token_ids"]) if prompt is None else prompt
    best, shared, rest = None, 0, []
    for lane in lanes:
        cut = lane.start_in(prompt)
        if cut is None:
            continue
        after = prompt.after(lane.prompt_len, cut)
        n = lane.prompt_len + _repeated(lane.completion, after)
        if n > shared:
            best, shared, rest = lane, n, after[n - lane.prompt_len:]
    if best is None:
        return {**record, "prompt_token_ids": prompt.ids()}
    prompt.counted(shared + len(rest))
    kept = shared_prefix(best.messages, [message_digest(m) for m in messages] if digests is None else digests)
    return {**record, "prompt_ref": best.completion_id, "prompt_ref_tokens": shared, "prompt_token_ids": rest,
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


__all__ = ["Lane", "MissingReference", "PACKED_FROM", "PromptIds", "by_reference", "ids_json", "message_digest",
           "prefix_breaks", "resolve_prompt", "shared_prefix", "whole", "whole_completions"]
