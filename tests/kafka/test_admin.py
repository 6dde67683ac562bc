"""`describe` (behind `forge-stream status`) on the real broker: lag of groups that never committed; the catalog's
message size limits on the topics and in the producer."""

import random
import time

from confluent_kafka import Consumer, KafkaError, KafkaException

from forge_stream.bench.codec import completion
from forge_stream.kafka.admin import describe, topic_problems
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
    assert lag["members"] == 1  # the consumer above, still in the group when `describe` read it
    holding = {f"{TOPICS.tasks.name}[{p}]" for p in range(TOPICS.tasks.partitions)
               if tasks["end_offsets"][p] > tasks["start_offsets"][p]}
    assert holding and sorted(lag["uncommitted"]) == sorted(holding)  # the empty partitions are not noise there


def test_topics_take_the_catalogs_message_sizes_and_the_producer_checks_them(kafka_bootstrap, run_id):
    assert topic_problems(kafka_bootstrap)["configs"] == []  # max.message.bytes included
    producer = EventProducer(kafka_bootstrap)
    rng = random.Random(0)
    try:
        record = completion(rng, 700_000, 10)  # about 2 MB: over Kafka's default 1 MB, within forge.completions
        record["completion_logprobs"] = record["completion_logprobs"][:10]
        assert producer.send_sync(TOPICS.completions, run_id, record) >= 0
        record["prompt_token_ids"] = record["prompt_token_ids"] * 5  # about 10 MB: over the topic's 8 MiB
        try:
            producer.send_sync(TOPICS.completions, run_id, record)
            raise AssertionError("an event over the topic's limit was sent")
        except KafkaException as exc:
            assert exc.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE and "forge.completions" in str(exc)
    finally:
        producer.close()


def test_a_stream_processors_state_topics_are_not_its_lag():
    from forge_stream.kafka.admin import _state_topic

    assert _state_topic("forge-processors-groups-changelog") and _state_topic("forge-processors-__assignor-__leader")
    assert not _state_topic("forge.completions") and not _state_topic("forge-processors-timeouts")


def test_a_group_committing_while_status_reads_never_lags_below_zero(kafka_bootstrap, run_id, monkeypatch):
    """Read the other way round (the end offsets, then the group's commits, which can move past them meanwhile),
    `status` shows a busy group's lag below zero (e.g. -7). Here the group writes and commits right after `describe`
    read the end offset."""
    from confluent_kafka import Producer, TopicPartition

    from forge_stream.kafka import admin
    from forge_stream.kafka.admin import scratch_topic

    group = f"busy-{run_id}"

    def commit_at_end(topic: str) -> None:
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for i in range(5):
            producer.produce(topic, b"x", partition=0)
        producer.flush(30)
        committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": False})
        try:
            end = committer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
            committer.commit(offsets=[TopicPartition(topic, 0, end)], asynchronous=False)
        finally:
            committer.close()

    with scratch_topic(kafka_bootstrap, f"lag-race-{run_id}", 1) as topic:
        commit_at_end(topic)  # 5 records, all committed

        class Racing:  # the Consumer `describe` reads end offsets with; the group moves on right after
            def __init__(self, config):
                self.real = Consumer(config)

            def get_watermark_offsets(self, tp, timeout):
                offsets = self.real.get_watermark_offsets(tp, timeout=timeout)
                if tp.topic == topic:
                    commit_at_end(topic)
                return offsets

            def close(self):
                self.real.close()

        monkeypatch.setattr(admin, "Consumer", Racing)
        status = describe(kafka_bootstrap)
        assert status["topics"][topic]["end_offsets"] == {0: 5}
        assert status["consumer_groups"][group]["lag"] == 0  # its commit at 5; read the other way round: -5
