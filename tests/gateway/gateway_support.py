"""Gateway test helpers: the admin token of the auth tests, opening a session over HTTP, and reading a group's
events back as an outside consumer does."""

import http.client
import json

import httpx
from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from forge_stream.kafka.consumer import low_high, offset_at_time
from forge_stream.kafka.reader import partition_records
from forge_stream.topics import TOPICS

ADMIN = "admin-secret"


def open_session(gateway: str, group_id: str, task_id: str = "task", token: str | None = None, **extra) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{gateway}/v1/sessions", json={"group_id": group_id, "task_id": task_id, **extra},
                          headers=headers)
    assert response.status_code == 201, response.text
    return response.json()


def on_one_connection(base_url: str, calls: list[tuple[str, str, bytes | None, dict]]) -> list[tuple[int, dict]]:
    """Send the calls (method, path, body, headers) one after another on one keep-alive HTTP/1.1 connection;
    the status and JSON body of each answer. Fails if the server drops or closes the connection in between."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    out, local = [], None
    try:
        for method, path, body, headers in calls:
            conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
            if local is None:
                local = conn.sock.getsockname()
            assert conn.sock.getsockname() == local, "the server closed the keep-alive connection"
            response = conn.getresponse()
            data = response.read()
            assert response.getheader("connection") != "close", f"{path} answered {response.status} and closed"
            out.append((response.status, json.loads(data) if data else {}))
    finally:
        conn.close()
    return out


GATEWAY_TOPICS = (TOPICS.sessions, TOPICS.completions, TOPICS.tool_spans, TOPICS.rewards)


def read_recorded(bootstrap: str, registry_url: str, group_id: str, since_ms: int = 0) -> dict[str, list[dict]]:
    """Every event the gateway wrote for `group_id` (the key of its records), topic name -> records in offset order,
    decoded by confluent-kafka's AvroDeserializer with the writer schemas it fetches from the registry API by the id
    each record carries. Reads each partition from its first record at or after `since_ms` (a time before the group's
    first event: the session broker's topics hold every earlier test's too) to its current end (acknowledged events
    are below it)."""
    deserializer = AvroDeserializer(SchemaRegistryClient({"url": registry_url}))
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"outside-{group_id}",
                         "enable.auto.commit": False})
    out: dict[str, list[dict]] = {topic.name: [] for topic in GATEWAY_TOPICS}
    try:
        partitions = [(topic.name, partition) for topic in GATEWAY_TOPICS for partition in range(topic.partitions)]
        def since(consumer: Consumer, topic: str, partition: int) -> tuple[int, int]:
            return offset_at_time(consumer, topic, partition, since_ms), low_high(consumer, topic, partition)[1]

        for msg in partition_records(consumer, partitions, 10, since):
            if msg.key() == group_id.encode():
                context = SerializationContext(msg.topic(), MessageField.VALUE)
                out[msg.topic()].append(deserializer(msg.value(), context))
    finally:
        consumer.close()
    return out
