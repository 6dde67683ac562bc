"""The pooled agent runner against real worker processes (tests/rollout/agent_worker.py)."""

import asyncio
import sys
from pathlib import Path

from forge_stream.rollout.agents import AgentContext
from forge_stream.rollout.pool import PooledCommandAgent

WORKER = f"{sys.executable} {Path(__file__).parent / 'agent_worker.py'}"


def ctx(**task) -> AgentContext:
    return AgentContext("s", "http://127.0.0.1:1/s/s/v1", "key", task)


def test_episodes_run_concurrently_on_few_processes(tmp_path):
    """8 episodes on 2 workers x 4 slots are all in flight at once: each waits for the other 7 (agent_worker's
    `meet`), and answers an error if they never come."""
    async def main():
        pool = PooledCommandAgent(WORKER, workers=2, per_worker=4)
        try:
            results = await asyncio.gather(*(pool(ctx(meet=[str(tmp_path), 8, 60], answer=i)) for i in range(8)))
            pids = {w.proc.pid for w in pool._workers}
        finally:
            await pool.aclose()
        return results, pids

    results, pids = asyncio.run(main())
    assert [r.output for r in results] == [str(i) for i in range(8)] and all(r.ok for r in results), results
    assert len(pids) == 2


def test_per_worker_bounds_the_episodes_in_flight(tmp_path):
    """1 worker x 2 slots: 3 episodes are never in flight at once (each waits 1 s for a third, in two waves), while 2
    are."""
    async def main(n: int):
        pool = PooledCommandAgent(WORKER, workers=1, per_worker=2)
        try:
            return await asyncio.gather(*(pool(ctx(meet=[str(tmp_path / str(n)), n, 1.0], answer=i))
                                          for i in range(4)))
        finally:
            await pool.aclose()

    for n in (2, 3):
        (tmp_path / str(n)).mkdir()
    three, two = asyncio.run(main(3)), asyncio.run(main(2))
    assert not any(r.ok for r in three) and "fewer than 3 episodes" in three[0].reason, three
    assert all(r.ok for r in two), two


def test_a_dying_worker_fails_only_its_episodes_and_is_restarted():
    async def main():
        pool = PooledCommandAgent(WORKER, workers=2, per_worker=2)
        try:
            # one slow episode on each worker; the crash then goes to the first worker, beside the victim
            victim = asyncio.ensure_future(pool(ctx(sleep=1.0, answer="victim")))
            await asyncio.sleep(0.3)
            slow_ok = asyncio.ensure_future(pool(ctx(sleep=1.0, answer="survivor")))
            await asyncio.sleep(0.05)
            crash = await pool(ctx(crash=True))
            results = [crash, await victim, await slow_ok]
            after = await pool(ctx(answer="after"))
            failed = await pool(ctx(fail="tool exploded"))
        finally:
            await pool.aclose()
        return results, after, failed

    (crash, victim, survivor), after, failed = asyncio.run(main())
    assert not crash.ok and "exited with 3" in crash.reason and "crashing on purpose" in crash.reason
    assert not victim.ok and "exited with 3" in victim.reason
    assert survivor.ok and survivor.output == "survivor"
    assert after.ok and after.output == "after"
    assert not failed.ok and failed.reason == "tool exploded"


def test_timeout_fails_the_episode():
    async def main():
        pool = PooledCommandAgent(WORKER, workers=1, per_worker=2, timeout_s=0.3)
        try:
            return await pool(ctx(sleep=2, answer=1)), await pool(ctx(answer=2))
        finally:
            await pool.aclose()

    slow, fast = asyncio.run(main())
    assert not slow.ok and "timed out" in slow.reason
    assert fast.ok and fast.output == "2"
