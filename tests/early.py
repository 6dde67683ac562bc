"""What the test session starts in the background as it begins: the engine server processes that fixtures of module or
session scope hold (real vLLM, and the torch engine), and the SmolLM2 import one of them serves, so that their
start-up runs while the tests before their users do, instead of in their users' setup. Most tests wait on Kafka,
HTTP and processes with the cores idle; a vLLM start is imports and compiling (on 2 cores: one to two and a half
minutes each, about 6 minutes of the suite's wall time for the three), a torch engine's about 15 s.

Each thing is declared where it is used, at import (so before the session starts): `EARLY.declare(name, wanted,
prepare, stop)`. `wanted(item)` says whether a selected test needs it; `prepare(get)` runs at the session's start in
the main thread (`get` gives session fixtures: the broker, tmp_path_factory, ...) and returns the slow part. The
slow parts run in one background thread, one after another in the order of their first users, so that at most one
start competes with the tests for the cores, each once the session is LEAD tests short of its first user, or its own
`lead` (a vLLM engine started with the session sat idle through 50 minutes of other tests holding 3 GB, and was the
process the kernel's OOM killer took when the suite's memory ran short), and once the start before it, if it holds
processes (it was declared with a `stop`), was taken: so at most one engine waits, started, for its users (with
`-m slow` every start was within its lead of the first test, and four vLLM engines and the KV tier's deployment, 5
GB an engine, came up together until the kernel killed one). One may wait for an earlier one's result
(`EARLY.result`: the SmolLM2 import, which holds no process, before the vLLM server on it). The fixture that owns
the thing calls `EARLY.take(name, get)`: it waits for that start and raises what it raised, or, where nothing was
begun (the test was not selected when the session started), runs both parts itself. From then on the fixture owns it
and stops it when its scope ends, as before; what no fixture took is stopped when the session ends
(tests/conftest.py), and what had not started by then never starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

Get = Callable[[str], Any]
LEAD = 60  # tests before its first user that a start begins: a few minutes of the suite, more than a vLLM start


@dataclass
class _Start:
    value: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    taken: bool = False


@dataclass(frozen=True)
class _Declared:
    wanted: Callable[[Any], bool]
    prepare: Callable[[Get], Callable[[], Any]]
    stop: Callable[[Any], None] | None
    lead: int


class Early:
    def __init__(self):
        self._declared: dict[str, _Declared] = {}
        self._starts: dict[str, _Start] = {}
        self._ending = threading.Event()
        self._index: dict[str, int] = {}  # a selected test's node id -> its place in the session
        self._reached = threading.Condition()
        self._at = 0  # the place of the test running now

    def declare(self, name: str, wanted: Callable[[Any], bool], prepare: Callable[[Get], Callable[[], Any]],
                stop: Callable[[Any], None] | None = None, lead: int = LEAD) -> None:
        self._declared[name] = _Declared(wanted, prepare, stop, lead)

    def begin(self, items: list, get: Get) -> list[str]:
        """Start what a selected test needs, one after another in the order the tests need them, in one thread (so
        that at most one start competes with the tests for the cores); the names begun, in that order."""
        first = {name: next((i for i, item in enumerate(items) if d.wanted(item)), None)
                 for name, d in self._declared.items()}
        begun = sorted((name for name, i in first.items() if i is not None), key=lambda name: first[name])
        self._index = {getattr(item, "nodeid", str(i)): i for i, item in enumerate(items)}
        queue = []
        for name in begun:
            self._starts[name] = _Start()
            queue.append((name, self._declared[name].prepare(get), max(0, first[name] - self._declared[name].lead)))
        if queue:
            threading.Thread(target=self._run, args=(queue,), name="early-starts", daemon=True).start()
        return begun

    def reached(self, nodeid: str) -> None:
        """The session runs this test now (tests/conftest.py calls it as each test starts)."""
        with self._reached:
            self._at = max(self._at, self._index.get(nodeid, 0))
            self._reached.notify_all()

    def _waiting(self, name: str) -> bool:
        """Whether `name`'s start holds processes that no fixture took yet."""
        start = self._starts[name]
        return self._declared[name].stop is not None and start.error is None and not start.taken

    def _run(self, queue: list[tuple[str, Callable[[], Any], int]]) -> None:
        before = None
        for name, slow, at in queue:
            start = self._starts[name]
            with self._reached:
                self._reached.wait_for(lambda: self._ending.is_set() or start.taken or (
                    self._at >= at and (before is None or not self._waiting(before))))
            before = name
            try:
                if self._ending.is_set():
                    raise RuntimeError("the session ended before this start")
                start.value = slow()
            except BaseException as exc:  # raised again in the test that takes it
                start.error = exc
            finally:
                start.done.set()

    def begun(self, name: str) -> bool:
        return name in self._starts

    def result(self, name: str) -> Any:
        """What `name`'s start made, once it is done (for a start that needs another's result, in its thread)."""
        start = self._starts[name]
        start.done.wait()
        if start.error is not None:
            raise start.error
        return start.value

    def take(self, name: str, get: Get) -> Any:
        """`name`'s value, from then on the caller's to stop: the early start's, or one made now."""
        if name not in self._starts:
            return self._declared[name].prepare(get)()
        with self._reached:
            self._starts[name].taken = True
            self._reached.notify_all()
        return self.result(name)

    def end(self) -> None:
        """Stop what was started and never taken (its tests were skipped, or the session stopped before them)."""
        with self._reached:
            self._ending.set()
            self._reached.notify_all()
        for name, start in self._starts.items():
            start.done.wait()
            stop = self._declared[name].stop
            if not start.taken and start.error is None and stop is not None:
                stop(start.value)
        self._starts.clear()


EARLY = Early()
