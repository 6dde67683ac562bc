"""The Parquet sink writes the reward stream from the real broker to Parquet files, one row per event."""

import pyarrow.dataset as ds

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
