"""Which partition a keyed record goes to: murmur2 of the key, as Kafka's Java client computes it.

Every producer of forge-stream partitions this way: librdkafka's `murmur2_random` partitioner (set in
`forge_stream.kafka.producer.producer_config`), aiokafka's default partitioner (faust's producer), and a grader or
agent written against Kafka's Java client, whose default partitioner places a keyed record at
`Utils.toPositive(Utils.murmur2(key)) % partitions`. So a Reward keyed by its group id lands on the partition of
the group's other events whatever client wrote it. `partition_for` is what code that reads a key's partition
computes (forge_stream.kafka.reader); tests/kafka/test_partitioner.py checks it against the Java client's own
classes and against where the broker stored records.
"""

from __future__ import annotations

SEED = 0x9747B28C
M = 0x5BD1E995
MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's `Utils.murmur2(data)` (MurmurHash2, 32 bits, little-endian words, seed 0x9747b28c), as the signed
    32-bit int Java returns.

    >>> murmur2(b"forge"), murmur2(b"")
    (1196596354, 275646681)
    """
    length = len(data)
    h = (SEED ^ length) & MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * M) & MASK
        k ^= k >> 24
        k = (k * M) & MASK
        h = ((h * M) & MASK) ^ k
    tail = length % 4
    if tail == 3:
        h ^= data[whole + 2] << 16
    if tail >= 2:
        h ^= data[whole + 1] << 8
    if tail >= 1:
        h ^= data[whole]
        h = (h * M) & MASK
    h ^= h >> 13
    h = (h * M) & MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of `partitions` that Kafka's Java client, librdkafka's murmur2_random and aiokafka put a record
    keyed `key` in (`Utils.toPositive(murmur2(key)) % partitions`).

    >>> partition_for(b"forge", 4)
    2
    """
    return (murmur2(key) & 0x7FFFFFFF) % partitions
