"""Keys land where Kafka's Java client puts them: our murmur2 computation, librdkafka's producer as configured
(`murmur2_random`) and faust's aiokafka producer all agree with the Java producer's own partitioner
(`BuiltInPartitioner.partitionForKey`, run from the kafka-clients jar the broker uses), both as computed and where
the broker stored the records; and every producer of the project is idempotent with acks=all."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from forge_stream.kafka.admin import scratch_topic
from forge_stream.kafka.broker import jar_dir
from forge_stream.kafka.partitioner import murmur2, partition_for
from forge_stream.kafka.producer import EventProducer, producer_config
from forge_stream.settings import ForgeSettings
from topologies.processors import TopologyConfig, build_app

JAVA_PROGRAM = Path(__file__).with_name("Murmur.java")
COUNTS = (4, 7, 12)  # the rollout topics' 4, and two that are not powers of two


def keys() -> list[bytes]:
    """Group ids as forge-stream writes them, non-ASCII text, and random bytes of every length 0 to 19 (each tail
    length of murmur2's 4-byte words, bytes over 0x7f that Java holds as negative)."""
    rng = random.Random(34)
    ids = [f"{rng.getrandbits(40):010x}-g{i}".encode() for i in range(40)]
    text = ["grupo-ñandú", "группа-7", "组-42", "🙂", "forge"]
    raw = [bytes(rng.getrandbits(8) for _ in range(n)) for n in range(20) for _ in range(3)]
    return ids + [t.encode() for t in text] + raw


def java_partitions(keys: list[bytes]) -> list[tuple[int, ...]]:
    """(murmur2, partition for each of COUNTS) of each key, as Kafka's Java client computes them."""
    libs = jar_dir(ForgeSettings().cache_dir)
    classpath = ":".join(str(next(libs.glob(pattern))) for pattern in ("kafka-clients-*.jar", "slf4j-api-*.jar"))
    java = shutil.which("java")
    assert java, "java is not on PATH (the broker needs it too)"
    out = subprocess.run([java, "-cp", classpath, str(JAVA_PROGRAM), *map(str, COUNTS)], capture_output=True,
                         text=True, timeout=120, input="".join(k.hex() + "\n" for k in keys))
    assert out.returncode == 0, out.stderr
    rows = [tuple(int(v) for v in line.split("\t")) for line in out.stdout.splitlines()]
    assert len(rows) == len(keys)
    return rows


@pytest.fixture(scope="module")
def java() -> dict[bytes, tuple[int, ...]]:
    sample = keys()
    return dict(zip(sample, java_partitions(sample)))


def test_our_murmur2_is_the_java_clients(java):
    assert any(row[0] < 0 for row in java.values()), "no key with a negative hash: the sign is not exercised"
    for key, (hashed, *partitions) in java.items():
        assert murmur2(key) == hashed, key
        assert [partition_for(key, n) for n in COUNTS] == partitions, key


def test_aiokafkas_default_partitioner_agrees(java, tmp_path):
    app = build_app(TopologyConfig("127.0.0.1:1", tmp_path))
    partitioner = app.producer.partitioner  # what faust hands its aiokafka producer (aiokafka's default)
    for key, (_, *partitions) in java.items():
        assert [partitioner(key, list(range(n)), list(range(n))) for n in COUNTS] == partitions, key


@pytest.mark.kafka
def test_records_land_on_the_java_clients_partition(java, kafka_bootstrap, run_id, tmp_path):
    sample = list(java)
    with scratch_topic(kafka_bootstrap, f"forge-test-partitions-{run_id}", 7) as topic:
        producer = EventProducer(kafka_bootstrap)
        landed: dict[bytes, int] = {}
        try:
            for key in sample:
                producer.produce_raw(topic, key, b"v", lambda err, msg: landed.__setitem__(msg.key(), msg.partition())
                                     if err is None else None)
            producer.flush()
        finally:
            producer.close()

        faust_landed = asyncio.run(_send_with_faust_producer(kafka_bootstrap, topic, sample, tmp_path))
    expected = {key: java[key][1 + COUNTS.index(7)] for key in sample}
    assert landed == expected, "librdkafka (murmur2_random) put a key elsewhere than Java's client would"
    assert faust_landed == expected, "faust's producer put a key elsewhere than Java's client would"
    assert len(set(expected.values())) == 7  # the sample spreads over every partition


async def _send_with_faust_producer(bootstrap: str, topic: str, sample: list[bytes], data_dir: Path) -> dict:
    """Send each key once with the aiokafka producer the processors' faust app makes; where each landed."""
    app = build_app(TopologyConfig(bootstrap, data_dir))
    producer = app.producer._new_producer()
    await producer.start()
    try:
        sent = [await producer.send(topic, b"v", key=key) for key in sample]
        return {key: (await future).partition for key, future in zip(sample, sent)}
    finally:
        await producer.stop()


def test_every_producer_is_idempotent_with_acks_all(tmp_path):
    config = producer_config("127.0.0.1:1")
    assert (config["enable.idempotence"], config["acks"], config["partitioner"]) == (True, "all", "murmur2_random")

    async def made(app) -> tuple[bool, int]:
        producer = app.producer._new_producer()  # the settings faust starts its aiokafka producer with
        try:
            return producer._txn_manager is not None, producer._sender._acks  # aiokafka: a manager iff idempotent
        finally:
            await producer.stop()

    app = build_app(TopologyConfig("127.0.0.1:1", tmp_path))
    assert asyncio.run(made(app)) == (True, -1)
    app.transport.Producer = type(app.transport).Producer  # faust's own producer, as faust configures it
    app.producer = None
    assert asyncio.run(made(app))[0] is False, "faust's default is idempotent now: the override may be redundant"
