"""Event contracts: Avro schemas with fixed ids, the Confluent-framed codec, and event identity helpers."""

from __future__ import annotations

import time
import uuid

from forge_stream.events.codec import DecodeError, decode, encode, peek, schema_id
from forge_stream.events.registry import RegistryError, SchemaRegistry, default_registry, load_registry

_NAMESPACE = uuid.UUID("6f0c1d2e-7a53-4c1b-9d8e-f0400b1e5eed")


def new_event_id() -> str:
    return uuid.uuid4().hex


def deterministic_id(*parts: object) -> str:
    """A stable id derived from the event's identity, so a replay or restart re-emits the same id."""
    return uuid.uuid5(_NAMESPACE, "\x1f".join(str(p) for p in parts)).hex


def now_ms() -> int:
    return time.time_ns() // 1_000_000


__all__ = [
    "DecodeError", "RegistryError", "SchemaRegistry", "decode", "default_registry", "deterministic_id",
    "encode", "load_registry", "new_event_id", "now_ms", "peek", "schema_id",
]
