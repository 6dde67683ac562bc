"""Task sources: where the rollout controller and the evaluator get their tasks (`TaskSpec`s).

A source is any re-iterable of `TaskSpec`: iterating it again starts it over (the controller's `--loop`).
`load_task_source` maps the string a user gives on the command line to one:

- a path: a JSONL file, one task a line (`task_id`, `prompt`, and optionally `reference`, `domain`, `grader`,
  `group_size`, `metadata`); it is read again each time it is iterated, so edits show up on the next cycle;
- `suite:<split>[?seed=..&mix=..&difficulty=..&group_size=..&temperature=..&skip=..]`: the shipped task suite
  (`forge_stream.tasks.suite.iter_tasks`), an endless seeded stream of one of its fixed splits (`train`,
  `validation`, `test`; `heldout` is `test`); `mix` is `agent=2,lookup=1`; `skip=N` starts the stream at its task
  N (e.g. past the N tasks `forge-stream sft --examples N` demonstrated from the same seed and mix). Which tasks
  belong to a split does not depend on the options, so an evaluation on `suite:test` is one set whatever the
  training stream's seed and mix.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import parse_qsl, urlsplit

from forge_stream.tasks.spec import TaskSpec


@dataclass(frozen=True)
class JsonlTasks:
    path: Path

    def __iter__(self) -> Iterator[TaskSpec]:
        with self.path.open() as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    yield TaskSpec.from_json(json.loads(line))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{self.path}:{number}: not a task ({type(exc).__name__}: {exc})") from exc


@dataclass(frozen=True)
class SuiteTasks:
    split: str
    options: tuple[tuple[str, str], ...] = ()

    def __iter__(self) -> Iterator[TaskSpec]:
        from forge_stream.tasks.suite import iter_tasks, parse_mix

        kwargs: dict = {}
        skip = 0
        for name, value in self.options:
            if name == "mix":
                kwargs["mix"] = parse_mix(value)
            elif name in ("seed", "difficulty", "group_size", "max_tokens"):
                kwargs[name] = int(value)
            elif name == "temperature":
                kwargs[name] = float(value)
            elif name == "skip":
                skip = int(value)
                if skip < 0:
                    raise ValueError(f"suite:{self.split}: skip must be 0 or more, not {skip}")
            else:
                raise ValueError(f"suite:{self.split}: unknown option {name!r} "
                                 "(known: seed, mix, difficulty, group_size, max_tokens, temperature, skip)")
        return itertools.islice(iter_tasks(self.split, **kwargs), skip, None)


@dataclass(frozen=True)
class ResizedTasks:
    """Every task of `source` with its group size G replaced (the command line's `--group-size`)."""

    source: Iterable[TaskSpec]
    group_size: int

    def __iter__(self) -> Iterator[TaskSpec]:
        return (replace(task, group_size=self.group_size) for task in self.source)


def load_task_source(spec: str) -> Iterable[TaskSpec]:
    """`suite:<split>[?options]` -> the task suite's stream; anything else is the path of a JSONL file."""
    if spec.startswith("suite:"):
        parts = urlsplit(spec)
        return SuiteTasks(parts.path, tuple(parse_qsl(parts.query, strict_parsing=bool(parts.query))))
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"no task file {spec!r} (give a JSONL file or suite:<split>)")
    return JsonlTasks(path)
