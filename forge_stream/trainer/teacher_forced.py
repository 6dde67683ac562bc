"""Teacher-forced scoring of ideal conversations: which parts of them a policy already gets right.

For each test task the scripted teacher's conversation (forge_stream.tasks.teacher) is rendered exactly as SFT
renders it, and the policy scores each assistant turn's tokens given the right prefix. Per domain and turn it
reports the probability of producing the whole turn right at temperature 1 and, split into digit and other
tokens, how often the right token is the most likely one and its mean probability. A turn whose argmax is right
but whose probability is low is a skill RL only has to sharpen; an argmax that is wrong is one it has to teach.
`forge-stream tasks probe --model DIR` prints it; the worst tokens (with their context) name what fails. `--by-kind`
reports per kind of task and turn instead (`task_kind`: a lookup key, an agent operator with its answer's length, a
reasoning template): which keys the policy calls right, which answers it copies.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from forge_stream.tasks.suite import make_tasks, task_kind
from forge_stream.tasks.teacher import demonstration
from forge_stream.trainer.sft import render_turns


@dataclass
class TokenStats:
    tokens: int = 0
    argmax_right: int = 0
    p_right: float = 0.0

    def as_dict(self) -> dict:
        n = max(self.tokens, 1)
        return {"tokens": self.tokens, "argmax_right": round(self.argmax_right / n, 4),
                "mean_p_right": round(self.p_right / n, 4)}


@dataclass
class TurnStats:
    turns: int = 0
    p_turn_right: float = 0.0
    by_kind: dict[str, TokenStats] = field(default_factory=lambda: collections.defaultdict(TokenStats))


def score_ideal_turns(model, tokenizer, n: int = 150, seed: int = 0, mix: dict[str, float] | None = None,
                      difficulty: int = 1, worst: int = 10, by_kind: bool = False) -> dict:
    """The report: {"turns": {"<domain>/<turn>": {...}}, "worst_tokens": [...]}; with by_kind, the turns are
    "<kind>/<turn>"."""
    stats: dict[tuple[str, int], TurnStats] = collections.defaultdict(TurnStats)
    misses: collections.Counter = collections.Counter()
    model.eval()
    with torch.no_grad():
        for task in make_tasks("test", n, seed=seed, mix=mix, difficulty=difficulty):
            for k, turn in enumerate(render_turns(tokenizer, demonstration(task.graded, task.domain))):
                ids = torch.tensor([turn.prompt_ids + turn.completion_ids])
                logits = model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1:-1].float()
                logprobs = torch.log_softmax(logits, -1)
                target = torch.tensor(turn.completion_ids)
                right = logprobs.gather(1, target[:, None])[:, 0]
                top = logprobs.argmax(-1)
                entry = stats[(task_kind(task.domain, task.graded) if by_kind else task.domain, k)]
                entry.turns += 1
                entry.p_turn_right += float(right.sum().exp())
                for j, token in enumerate(turn.completion_ids):
                    text = tokenizer.decode([token])
                    kind = entry.by_kind["digit" if text.strip().isdigit() else "other"]
                    kind.tokens += 1
                    kind.argmax_right += int(top[j] == token)
                    kind.p_right += float(right[j].exp())
                    if top[j] != token:
                        before = tokenizer.decode(turn.completion_ids[max(0, j - 3):j])
                        misses[(task.domain, k, before, text, tokenizer.decode([int(top[j])]))] += 1
    turns = {f"{d}/{k}": {"turns": s.turns, "p_turn_right": round(s.p_turn_right / s.turns, 4),
                          **{kind: t.as_dict() for kind, t in sorted(s.by_kind.items())}}
             for (d, k), s in sorted(stats.items())}
    worst_tokens = [{"domain": d, "turn": k, "after": before, "right": text, "argmax": top, "count": count}
                    for (d, k, before, text, top), count in misses.most_common(worst)]
    return {"tasks": n, "turns": turns, "worst_tokens": worst_tokens}
