"""A Parquet sink: consumes reward and trajectory streams and writes them as Parquet files for offline analysis.

Records are flattened to one row per event (nested lists and records as JSON strings), buffered, and written as
one file per partition and flush under `<out>/<topic>/part-<partition>-<first offset>.parquet`. The name depends
only on where the file starts, and a file holds its partition's rows from the committed offset on, so a re-run
after a crash (the file was written, its offsets not committed) writes a file of the same name, whatever its
flush timing, and replaces the old one instead of duplicating its rows. A file appears whole or not at all (written aside, then
renamed). Offsets are committed only after the files are on disk, and a dead letter's offset only with the rows
before it: a record that cannot be decoded never commits past buffered rows.

Each file's columns are typed from the event's Avro schema (`arrow_schema`), not guessed from its rows: a flush
whose rows all have a null `turn` would otherwise write a null-typed column, and a dataset of such files and others
with integer turns cannot be read.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from forge_stream.kafka.consumer import DecodingConsumer, Event
from forge_stream.topics import TOPICS, Topic


@dataclass(frozen=True)
class ParquetSinkSettings:
    bootstrap: str
    out_dir: Path
    topics: tuple[str, ...] = (TOPICS.rewards.name, TOPICS.trajectories.name)
    group_id: str = "forge-parquet-sink"
    flush_records: int = 1000
    flush_seconds: float = 10.0


_ARROW = {"string": pa.string(), "long": pa.int64(), "int": pa.int32(), "double": pa.float64(),
          "float": pa.float32(), "boolean": pa.bool_(), "bytes": pa.binary()}


def _arrow_type(avro) -> pa.DataType:
    """A column's type: the Avro type with null unions made nullable, nested values as their JSON text."""
    if isinstance(avro, list):  # a union: ["null", X] is a nullable X
        kinds = [t for t in avro if t != "null"]
        return _arrow_type(kinds[0]) if len(kinds) == 1 else pa.string()
    if isinstance(avro, dict):
        return _ARROW.get(avro.get("type"), pa.string()) if avro.get("type") in _ARROW else pa.string()
    return _ARROW.get(avro, pa.string())


def arrow_schema(schema_name: str) -> pa.Schema:
    """The Parquet columns of one event type (its latest registered Avro schema) plus where each row was read."""
    from forge_stream.events.registry import default_registry

    fields = default_registry().latest(schema_name).parsed["fields"]
    return pa.schema([pa.field(f["name"], _arrow_type(f["type"])) for f in fields]
                     + [pa.field("_topic", pa.string()), pa.field("_partition", pa.int32()),
                        pa.field("_offset", pa.int64())])


def flatten(event: Event) -> dict:
    row = {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in event.record.items()}
    row.update(_topic=event.topic, _partition=event.partition, _offset=event.offset)
    return row


class ParquetSink:
    def __init__(self, settings: ParquetSinkSettings):
        self.settings = settings
        topics: list[Topic] = [TOPICS.by_name(name) for name in settings.topics]
        self.consumer = DecodingConsumer(settings.bootstrap, settings.group_id, topics, name="parquet-sink")
        self.buffers: dict[tuple[str, int], list[Event]] = {}
        self.files_written: list[Path] = []

    def poll(self, timeout: float) -> bool:
        """Buffer at most one event; False when none arrived."""
        event = self.consumer.poll(timeout)
        if event is None:
            return False
        self.buffers.setdefault((event.topic, event.partition), []).append(event)
        return True

    def flush(self) -> None:
        """Write each partition's buffer as one file, then commit what was read (rows and dead letters)."""
        for (topic, partition), events in self.buffers.items():
            if not events:
                continue
            folder = self.settings.out_dir / topic
            folder.mkdir(parents=True, exist_ok=True)
            name = f"part-{partition}-{events[0].offset:012d}.parquet"
            tmp = folder / f".{name}.tmp"  # dot files are invisible to Parquet dataset readers
            kinds = {e.schema for e in events}  # one per topic, except on topics that carry several event types
            schema = arrow_schema(kinds.pop()) if len(kinds) == 1 else None
            pq.write_table(pa.Table.from_pylist([flatten(e) for e in events], schema=schema), tmp)
            tmp.replace(folder / name)
            self.files_written.append(folder / name)
        self.buffers.clear()
        self.consumer.commit()

    def run(self, max_seconds: float | None = None, idle_exit_seconds: float | None = None) -> int:
        """Consume and write until stopped (or a time limit / idle period, for batch use); returns rows written."""
        start = last_flush = last_event = time.monotonic()
        rows = 0
        while max_seconds is None or time.monotonic() - start < max_seconds:
            got = self.poll(0.5)
            now = time.monotonic()
            if got:
                rows += 1
                last_event = now
            buffered = sum(map(len, self.buffers.values()))
            if buffered >= self.settings.flush_records or (buffered and now - last_flush >= self.settings.flush_seconds):
                self.flush()
                last_flush = now
            if idle_exit_seconds is not None and now - last_event >= idle_exit_seconds:
                break
        self.flush()
        self.consumer.close()
        return rows
