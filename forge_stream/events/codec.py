"""Avro encoding in the Confluent wire format: magic byte 0, a 4-byte big-endian schema id, the Avro body.

Writers always use the latest version of a record; readers resolve whatever version wrote the bytes (found by
its id) to the latest version, so consumers read old records with new fields filled from their defaults.
"""

from __future__ import annotations

import io
import struct

from fastavro import schemaless_reader, schemaless_writer

from forge_stream.events.registry import SchemaRegistry, default_registry

MAGIC = 0
_HEADER = struct.Struct(">bI")


class DecodeError(ValueError):
    """Bytes that are not a forge-stream event; the message says what is wrong with them."""


def encode(schema: str, record: dict, registry: SchemaRegistry | None = None) -> bytes:
    """Frame and encode `record` with the latest version of `schema` ("Completion" or its full name)."""
    entry = (registry or default_registry()).latest(schema)
    out = io.BytesIO()
    out.write(_HEADER.pack(MAGIC, entry.id))
    try:
        schemaless_writer(out, entry.writer, record, strict_allow_default=True)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"record does not match schema {entry.name} v{entry.version}: {exc}") from exc
    return out.getvalue()


def schema_id(data: bytes) -> int:
    """The schema id in a framed message's header."""
    if len(data) < _HEADER.size:
        raise DecodeError(f"{len(data)} bytes is too short for the 5-byte Confluent header")
    magic, sid = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DecodeError(f"bad magic byte {magic:#04x} (expected 0x00): not Confluent-framed Avro")
    return sid


def decode(data: bytes, registry: SchemaRegistry | None = None) -> tuple[str, dict]:
    """Return (short schema name, record read with the latest version of that schema)."""
    registry = registry or default_registry()
    sid = schema_id(data)
    writer = registry.by_id.get(sid)
    if writer is None:
        raise DecodeError(f"unknown schema id {sid}: not in schemas/registry.json (is this build older than the producer?)")
    reader = registry.latest(writer.name)
    body = io.BytesIO(data)
    body.seek(_HEADER.size)
    try:
        record = schemaless_reader(body, writer.parsed, reader.parsed)
    except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError... on corrupt bodies
        raise DecodeError(f"corrupt {writer.name} body (schema id {sid}): {type(exc).__name__}: {exc}") from exc
    if body.tell() != len(data):
        raise DecodeError(f"{len(data) - body.tell()} trailing bytes after a {writer.name} record (schema id {sid})")
    return writer.short_name, record


def _long(data: bytes, pos: int) -> tuple[int, int]:
    """An Avro int or long (zigzag varint) at `pos`; returns it and the position after it."""
    shift = value = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value >> 1) ^ -(value & 1), pos
        shift += 7


def peek(data: bytes, fields: tuple[str, ...], registry: SchemaRegistry | None = None) -> tuple[str, dict]:
    """(short schema name, `fields` of the record) read from the leading fields of its writer's schema without
    decoding the rest: a few microseconds where `decode` of a Completion with its token ids takes about a
    millisecond. Only string, int, long and boolean fields may come before the last one asked for (the schema's
    order); otherwise the whole record is decoded.

    >>> data = encode("SessionStarted", {"event_id": "e", "event_time": 5, "session_id": "s", "group_id": "g",
    ...                                  "task_id": "t", "base_url": "u", "metadata": {}})
    >>> peek(data, ("session_id", "event_time"))
    ('SessionStarted', {'event_time': 5, 'session_id': 's'})
    """
    registry = registry or default_registry()
    sid = schema_id(data)
    writer = registry.by_id.get(sid)
    if writer is None:
        raise DecodeError(f"unknown schema id {sid}: not in schemas/registry.json")
    found: dict = {}
    pos = _HEADER.size
    try:
        for field in writer.parsed["fields"]:
            if len(found) == len(fields):
                return writer.short_name, found
            kind = field["type"]
            if isinstance(kind, dict):  # a primitive with attributes (e.g. a long that was a timestamp-millis)
                kind = kind["type"]
            if kind in ("int", "long"):
                value, pos = _long(data, pos)
            elif kind == "string":
                size, pos = _long(data, pos)
                value, pos = data[pos:pos + size].decode(), pos + size
            elif kind == "boolean":
                value, pos = data[pos] == 1, pos + 1
            else:
                break
            if field["name"] in fields:
                found[field["name"]] = value
    except (IndexError, UnicodeDecodeError) as exc:
        raise DecodeError(f"corrupt {writer.name} body (schema id {sid}): {type(exc).__name__}: {exc}") from exc
    if len(found) == len(fields):
        return writer.short_name, found
    name, record = decode(data, registry)
    return name, {f: record[f] for f in fields}
