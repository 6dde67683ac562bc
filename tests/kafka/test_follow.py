"""`Follower` on a real broker: how every engine reads forge.policy (its history, then what came while it was busy
loading a version), keeping its own run's records only."""

import asyncio
import time
import uuid

from forge_stream.engine.shared.follower import newest
from forge_stream.kafka.follow import Follower
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def _publish(bootstrap: str, run: str, versions: range) -> None:
    producer = EventProducer(bootstrap)
    for v in versions:
        producer.send_sync(TOPICS.policy, run, {
            "event_id": uuid.uuid4().hex, "event_time": int(time.time() * 1000), "version": v, "step": v,
            "checkpoint_uri": f"/ckpt/{run}/v{v}", "base_model": "/base"})
    producer.close()


def test_a_follower_reads_its_runs_history_then_all_that_came_while_it_was_busy(kafka_bootstrap, run_id):
    mine, other = f"{run_id}-mine", f"{run_id}-other"
    _publish(kafka_bootstrap, mine, range(1, 4))
    _publish(kafka_bootstrap, other, range(1, 3))

    async def follow():
        async with Follower(kafka_bootstrap, TOPICS.policy, mine) as policy:
            history = await policy.backlog()
            nothing = await policy.caught_up()
            _publish(kafka_bootstrap, mine, range(4, 44))  # a trainer that published 40 versions during a load
            _publish(kafka_bootstrap, other, range(3, 6))
            meanwhile = await policy.caught_up()
            return history, nothing, meanwhile, await policy.caught_up()

    history, nothing, meanwhile, after = asyncio.run(follow())
    assert [r["version"] for r in history] == [1, 2, 3]
    assert nothing == [] and after == []
    assert [r["version"] for r in meanwhile] == list(range(4, 44))
    assert {r["checkpoint_uri"].split("/")[2] for r in history + meanwhile} == {mine}
    assert newest(meanwhile, current=3)["version"] == 43  # the engine skips to the newest
