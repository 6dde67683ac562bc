"""Incremental detokenization with stop strings: which text a choice may release after each new token.

Text is decoded from all of the choice's token ids each step (cheap at our lengths and always consistent with
`tokenizer.decode(token_ids)`). An unfinished UTF-8 sequence at the end ("\\ufffd") is held back, and so are the
last `len(longest stop) - 1` characters, so a stream never shows part of a stop string. When a stop string
appears the text is cut before it (or after it with include_stop_str_in_output), as vLLM does; the token ids
keep every generated token.
"""

from dataclasses import dataclass, field
from typing import Callable

Decode = Callable[[list[int]], str]


@dataclass
class IncrementalText:
    """Released text of one choice."""

    decode: Decode
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    released: str = ""
    stop_hit: str | None = field(default=None)

    def step(self, token_ids: list[int], final: bool) -> str:
        """Update with the choice's token ids so far; return the newly released text.

        After a stop string is found `stop_hit` holds it and the caller must finish the choice.
        """
        full = self.decode(token_ids)
        for s in self.stop:
            at = full.find(s, max(0, len(self.released) - len(s) + 1))
            if at >= 0 and (self.stop_hit is None or at < full.find(self.stop_hit)):
                self.stop_hit = s
        if self.stop_hit is not None:
            at = full.find(self.stop_hit)
            target = full[: at + len(self.stop_hit)] if self.include_stop else full[:at]
        elif final:
            target = full
        else:
            target = full.rstrip("\ufffd")
            if self.stop:
                target = target[: max(len(self.released), len(target) - max(map(len, self.stop)) + 1)]
        delta = target[len(self.released):] if target.startswith(self.released) else ""
        self.released += delta
        return delta
