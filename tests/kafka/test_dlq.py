"""Undecodable records go to forge.dlq with their original bytes; the consumer goes on (real broker)."""

import time

from confluent_kafka import Producer
from fastavro.utils import generate_one

from forge_stream.events import decode, default_registry, encode
from forge_stream.kafka.consumer import DecodingConsumer
from forge_stream.topics import TOPICS


def _reward(run_id, i):
    record = generate_one(default_registry().latest("Reward").parsed)
    record.update(event_id=f"{run_id}-{i}", group_id=run_id, value=float(i))
    return record


def test_bad_records_go_to_the_dlq_and_consumption_goes_on(kafka_bootstrap, run_id):
    raw = Producer({"bootstrap.servers": kafka_bootstrap})
    garbage = [b"not avro at all", b"\x00\x00\x00\x03\xe7garbage-with-unknown-id",
               encode("Task", generate_one(default_registry().latest("Task").parsed))]  # wrong schema for topic
    sent = []
    for i in range(3):
        record = _reward(run_id, i)
        raw.produce(TOPICS.rewards.name, key=run_id.encode(), value=encode("Reward", record))
        sent.append(record["event_id"])
        raw.produce(TOPICS.rewards.name, key=run_id.encode(), value=garbage[i])
    last = _reward(run_id, 3)  # one key, one partition: once this is read, every record before it was handled
    raw.produce(TOPICS.rewards.name, key=run_id.encode(), value=encode("Reward", last))
    sent.append(last["event_id"])
    assert raw.flush(10) == 0

    consumer = DecodingConsumer(kafka_bootstrap, f"test-dlq-{run_id}", [TOPICS.rewards], name="test-dlq")
    got = []
    deadline = time.monotonic() + 60
    # other tests' garbage on this shared topic is dead-lettered too, so count our records, not dead_letters
    while last["event_id"] not in got and time.monotonic() < deadline:
        event = consumer.poll(1.0)
        if event is not None and event.record["group_id"] == run_id:
            got.append(event.record["event_id"])
            consumer.commit()
    consumer.close()
    assert got == sent

    reader = DecodingConsumer(kafka_bootstrap, f"test-dlq-read-{run_id}", [TOPICS.dlq], name="reader")
    letters = []
    deadline = time.monotonic() + 60
    while len(letters) < 3 and time.monotonic() < deadline:
        event = reader.poll(1.0)
        if event is not None and event.record["key"] == run_id.encode() and event.record["rejected_by"] == "test-dlq":
            letters.append(event.record)
    reader.close()
    assert [l["value"] for l in letters] == garbage
    assert all(l["topic"] == TOPICS.rewards.name and l["rejected_by"] == "test-dlq" for l in letters)
    assert "bad magic byte" in letters[0]["error"]
    assert "unknown schema id 999" in letters[1]["error"]
    assert "carries Reward, not Task" in letters[2]["error"]
    assert len({l["offset"] for l in letters}) == 3
    assert decode(encode("DeadLetter", letters[0]))[1] == letters[0]
