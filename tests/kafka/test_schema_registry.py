"""An analytics job with confluent-kafka's own SchemaRegistryClient and AvroDeserializer decodes our topics."""

import time

import httpx
import pytest
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from fastavro.utils import generate_one
from helpers import serving

from forge_stream.events import default_registry
from forge_stream.kafka.producer import EventProducer
from forge_stream.schema_registry import create_app
from forge_stream.topics import TOPICS


@pytest.fixture(scope="module")
def registry_url():
    with serving(create_app()) as url:
        yield url


def test_registry_answers_the_confluent_api(registry_url):
    subjects = httpx.get(registry_url + "/subjects").json()
    assert "forge.completions-value" in subjects and "forge.events.Completion" in subjects
    assert httpx.get(registry_url + "/subjects/forge.events.Completion/versions").json() == [1, 2, 3, 4, 5, 6, 7]
    latest = httpx.get(registry_url + "/subjects/forge.completions-value/versions/latest").json()
    assert latest["id"] == default_registry().latest("Completion").id and latest["version"] == 7
    missing = httpx.get(registry_url + "/subjects/nope/versions/latest")
    assert missing.status_code == 404 and missing.json()["error_code"] == 40401
    assert httpx.get(registry_url + "/schemas/ids/999").json()["error_code"] == 40403
    assert httpx.post(registry_url + "/subjects/x/versions", json={}).status_code == 405


def test_confluent_avro_deserializer_decodes_our_topic(kafka_bootstrap, registry_url, run_id):
    client = SchemaRegistryClient({"url": registry_url})
    assert client.get_latest_version("forge.events.Reward").schema_id == default_registry().latest("Reward").id
    deserializer = AvroDeserializer(client)
    producer = EventProducer(kafka_bootstrap)
    sent = []
    for i in range(4):
        record = generate_one(default_registry().latest("Reward").parsed)
        record.update(event_id=f"{run_id}-{i}", group_id=run_id, value=i / 4, event_time=1_764_000_000_000 + i)
        producer.send_sync(TOPICS.rewards, run_id, record)
        sent.append(record)
    producer.close()

    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"analytics-{run_id}",
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([TOPICS.rewards.name])
    got = []
    deadline = time.monotonic() + 60
    while len(got) < len(sent) and time.monotonic() < deadline:
        msg = consumer.poll(1.0)
        if msg is None or msg.error() or msg.key() != run_id.encode():
            continue
        got.append(deserializer(msg.value(), SerializationContext(msg.topic(), MessageField.VALUE)))
    consumer.close()
    assert [g["event_id"] for g in got] == [s["event_id"] for s in sent]
    assert [g["value"] for g in got] == [s["value"] for s in sent]
    assert got[0]["event_time"].timestamp() * 1000 == sent[0]["event_time"]  # logical type for outsiders
