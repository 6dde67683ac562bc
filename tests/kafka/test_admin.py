"""`describe` (behind `forge-stream status`) on the real broker: lag of groups that never committed."""

import time

from confluent_kafka import Consumer

from forge_stream.kafka.admin import describe
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def test_a_group_that_never_committed_lags_by_the_whole_partition(kafka_bootstrap, run_id):
    producer = EventProducer(kafka_bootstrap)
    for i in range(3):
        producer.send_sync(TOPICS.tasks, f"{run_id}-g{i}", {
            "event_id": f"{run_id}-{i}", "event_time": 1_764_000_000_000, "task_id": "t", "group_id": f"{run_id}-g{i}",
            "seq": i, "domain": "qa", "grader": "exact", "group_size": 1, "prompt_json": "{}", "metadata": {}})
    producer.close()
    group = f"never-commits-{run_id}"
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([TOPICS.tasks.name])
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.5)
        assert consumer.assignment()
        status = describe(kafka_bootstrap)
    finally:
        consumer.close()
    tasks = status["topics"][TOPICS.tasks.name]
    whole = sum(tasks["end_offsets"][p] - tasks["start_offsets"][p] for p in range(TOPICS.tasks.partitions))
    lag = status["consumer_groups"][group]
    assert whole >= 3 and lag["lag"] == whole, "nothing committed: every record of the partitions is behind"
    assert lag["lag_by_topic"] == {TOPICS.tasks.name: whole}
    assert len(lag["uncommitted"]) == TOPICS.tasks.partitions
