"""Event contracts: Avro schemas with fixed ids, the Confluent-framed codec, and event identity helpers."""

from __future__ import annotations

import hashlib
import os
import time
import uuid

from forge_stream.events.codec import DecodeError, decode, encode, peek, schema_id
from forge_stream.events.registry import RegistryError, SchemaRegistry, default_registry, load_registry

_NAMESPACE = uuid.UUID("6f0c1d2e-7a53-4c1b-9d8e-f0400b1e5eed")


_VERSION_BITS = ~(0xF000 << 64 | 0xC000 << 48)  # the bits of a UUID's version and variant fields


def _uuid_hex(value: int, version: int) -> str:
    """The hex of the RFC 4122 UUID `version` made of the 128-bit `value`, as `uuid.UUID(int=...,
    version=...).hex` writes it, without building the UUID object (two per gateway call)."""
    return f"{value & _VERSION_BITS | version << 76 | 0x8000 << 48:032x}"


def new_event_id() -> str:
    """A random id (a UUID4's hex).

    >>> uuid.UUID(new_event_id()).version
    4
    """
    return _uuid_hex(int.from_bytes(os.urandom(16), "big"), 4)


def deterministic_id(*parts: object) -> str:
    """A stable id derived from the event's identity (a UUID5's hex), so a replay or restart re-emits the same id.

    >>> deterministic_id("completion", "s", "r", 0) == uuid.uuid5(_NAMESPACE, "completion\x1fs\x1fr\x1f0").hex
    True
    """
    name = "\x1f".join(str(p) for p in parts).encode()
    return _uuid_hex(int.from_bytes(hashlib.sha1(_NAMESPACE.bytes + name).digest()[:16], "big"), 5)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


__all__ = [
    "DecodeError", "RegistryError", "SchemaRegistry", "decode", "default_registry", "deterministic_id",
    "encode", "load_registry", "new_event_id", "now_ms", "peek", "schema_id",
]
