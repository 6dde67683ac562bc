"""The Parquet sink writes the reward stream from the real broker to Parquet files, one row per event, and neither
loses nor duplicates rows across a crash."""

import time
from dataclasses import replace

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from connectors.parquet_sink import ParquetSink, ParquetSinkSettings
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS


def test_rewards_land_in_parquet(kafka_bootstrap, run_id, tmp_path):
    producer = EventProducer(kafka_bootstrap)
    for i in range(12):
        producer.send_sync(TOPICS.rewards, run_id, {
            "event_id": f"{run_id}-{i}", "event_time": 1_764_000_000_000 + i, "group_id": run_id, "task_id": "t",
            "session_id": f"s{i % 3}", "kind": "outcome", "name": "exact_match", "value": i / 10, "turn": None,
            "source": "grader", "metadata": {"domain": "qa"}})
    producer.close()
    sink = ParquetSink(ParquetSinkSettings(kafka_bootstrap, tmp_path, topics=(TOPICS.rewards.name,),
                                           group_id=f"sink-{run_id}", flush_records=5, flush_seconds=1.0))
    sink.run(max_seconds=60, idle_exit_seconds=5)
    table = ds.dataset(tmp_path / TOPICS.rewards.name, format="parquet").to_table()
    mine = table.filter(ds.field("group_id") == run_id).sort_by("event_time").to_pylist()
    assert [r["value"] for r in mine] == [i / 10 for i in range(12)]
    assert mine[0]["metadata"] == '{"domain": "qa"}' and mine[0]["session_id"] == "s0"
    assert len({(r["_partition"], r["_offset"]) for r in mine}) == 12


class Crash(Exception):
    pass


def _rewards(bootstrap, run_id, n, garbage=False):
    producer = EventProducer(bootstrap)
    for i in range(n):
        producer.send_sync(TOPICS.rewards, run_id, {
            "event_id": f"{run_id}-{i}", "event_time": 1_764_000_000_000 + i, "group_id": run_id, "task_id": "t",
            "session_id": "s", "kind": "outcome", "name": "exact_match", "value": float(i), "turn": None,
            "source": "grader", "metadata": {}})
    if garbage:  # same key, so it sits behind the rows above in their partition
        producer.produce_raw(TOPICS.rewards.name, run_id.encode(), b"not avro")
    producer.close()


def _read_up(sink, run_id, n):
    """Poll until the sink buffered our n rows and then found nothing more to read."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = sink.poll(1.0)
        mine = sum(e.record["group_id"] == run_id for events in sink.buffers.values() for e in events)
        if mine == n and not got:
            return
    raise TimeoutError(f"buffered {mine} of {n} rows")


def _rows(path):
    return ds.dataset(path / TOPICS.rewards.name, format="parquet").to_table().to_pylist()


def test_a_dead_letter_does_not_commit_past_buffered_rows(kafka_bootstrap, run_id, tmp_path):
    _rewards(kafka_bootstrap, run_id, 5, garbage=True)
    settings = ParquetSinkSettings(kafka_bootstrap, tmp_path, topics=(TOPICS.rewards.name,),
                                   group_id=f"sink-{run_id}", flush_records=100_000, flush_seconds=3600)
    sink = ParquetSink(settings)
    _read_up(sink, run_id, 5)
    assert sink.consumer.dead_letters >= 1
    sink.consumer.close()  # the sink dies before its first flush
    ParquetSink(settings).run(max_seconds=60, idle_exit_seconds=3)
    mine = [r for r in _rows(tmp_path) if r["group_id"] == run_id]
    assert sorted(r["value"] for r in mine) == [float(i) for i in range(5)], "rows before the dead letter were lost"


def test_a_rewrite_after_a_crash_replaces_files_whatever_the_flush_timing(kafka_bootstrap, run_id, tmp_path):
    _rewards(kafka_bootstrap, run_id, 12)
    settings = ParquetSinkSettings(kafka_bootstrap, tmp_path, topics=(TOPICS.rewards.name,),
                                   group_id=f"sink-{run_id}", flush_records=100_000, flush_seconds=3600)
    sink = ParquetSink(settings)
    _read_up(sink, run_id, 12)

    def crash():
        raise Crash("killed between writing the files and committing their offsets")

    sink.consumer.commit = crash
    with pytest.raises(Crash):
        sink.flush()
    sink.consumer.close()
    assert any(r["group_id"] == run_id for r in _rows(tmp_path))

    rerun = ParquetSink(replace(settings, flush_records=5))  # other flush boundaries than the first run
    rerun.run(max_seconds=120, idle_exit_seconds=3)
    rows = _rows(tmp_path)
    keys = [(r["_partition"], r["_offset"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row was written twice"
    assert sorted(r["value"] for r in rows if r["group_id"] == run_id) == [float(i) for i in range(12)]


def test_columns_are_typed_from_the_avro_schema_whatever_a_flush_holds(tmp_path):
    """A flush whose rewards all have a null turn and one whose turns are numbers make one readable dataset."""
    from connectors.parquet_sink import arrow_schema, flatten
    from forge_stream.kafka.consumer import Event

    def reward(i, turn):
        record = {"event_id": f"r{i}", "event_time": i, "group_id": "g", "task_id": "t", "session_id": "s",
                  "kind": "total", "name": "composite", "value": 0.5, "turn": turn, "source": "processors",
                  "metadata": {}}
        return Event(TOPICS.rewards.name, 0, i, "g", "Reward", record, i)

    for name, turns in (("a", [None, None]), ("b", [3, 4])):
        rows = [flatten(reward(i, t)) for i, t in enumerate(turns)]
        pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema("Reward")), tmp_path / f"{name}.parquet")
    table = ds.dataset(tmp_path, format="parquet").to_table()
    assert sorted(table.column("turn").to_pylist(), key=str) == [3, 4, None, None]
    assert table.schema.field("turn").type == pa.int32() and table.schema.field("metadata").type == pa.string()
