"""The engine pool and its cost-aware router: a group's requests go to the same engine (its KV prefix is there)
unless that engine's queue is too long, then to the least loaded one.

The preferred engine of a group is chosen by rendezvous hashing, so it is stable without shared state and moves
only the groups of an engine that is added or removed. Load is the number of requests in flight per engine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass
class Engine:
    url: str
    in_flight: int = 0


def _score(group_id: str, url: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{group_id}\x1f{url}".encode(), digest_size=8).digest(), "big")


def preference(group_id: str, urls: list[str]) -> list[int]:
    """Engine indexes in the group's rendezvous order (best first)."""
    return sorted(range(len(urls)), key=lambda i: _score(group_id, urls[i]), reverse=True)


def choose(group_id: str, urls: list[str], loads: list[int], max_queue: int) -> list[int]:
    """Engines to try, in order: the group's home engine first unless its queue is over `max_queue` and another
    engine has fewer requests in flight; then the others by load.

    >>> choose("g", ["a"], [100], 4)
    [0]
    >>> home = preference("g", ["a", "b"])[0]
    >>> choose("g", ["a", "b"], [0, 0], 4)[0] == home
    True
    >>> loads = [0, 0]; loads[home] = 9
    >>> choose("g", ["a", "b"], loads, 4)[0] == 1 - home
    True
    """
    order = preference(group_id, urls)
    home = order[0]
    rest = sorted(order[1:], key=lambda i: loads[i])
    if rest and loads[home] > max_queue and loads[rest[0]] < loads[home]:
        return rest + [home]
    return [home] + rest


class EnginePool:
    def __init__(self, urls: tuple[str, ...], max_queue: int):
        if not urls:
            raise ValueError("the gateway needs at least one engine URL")
        self.engines = [Engine(url.rstrip("/")) for url in urls]
        self._urls = [e.url for e in self.engines]
        self.max_queue = max_queue

    def order(self, group_id: str) -> list[Engine]:
        if len(self.engines) == 1:
            return self.engines
        loads = [e.in_flight for e in self.engines]
        return [self.engines[i] for i in choose(group_id, self._urls, loads, self.max_queue)]
