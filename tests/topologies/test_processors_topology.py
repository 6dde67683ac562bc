"""The processors topology on the real broker: samples and rewards equal the pure functions' results, bad
records go to forge.dlq, a timed-out group closes with what finished, a group of failed sessions is skipped, and a SIGKILLed worker restarted from
its changelog still yields exactly one sample per group, with the same content."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from confluent_kafka import Consumer

from forge_stream.events import decode, encode, now_ms
from forge_stream.kafka.consumer import partition_positions
from forge_stream.kafka.producer import EventProducer
from forge_stream.processors import ProcessorSettings, expire, fold
from forge_stream.processors.synthetic import group_events
from forge_stream.topics import TOPICS

pytestmark = pytest.mark.kafka
REPO = Path(__file__).resolve().parents[2]
SCHEMA_TOPIC = {"Task": TOPICS.tasks, "SessionStarted": TOPICS.sessions, "SessionFinished": TOPICS.sessions,
                "Completion": TOPICS.completions, "ToolSpan": TOPICS.tool_spans, "Reward": TOPICS.rewards}


def start_worker(bootstrap: str, app_id: str, data_dir: Path, timeout_s: float) -> subprocess.Popen:
    log = open(data_dir.parent / f"{app_id}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-c", "from forge_stream.cli import main; main()", "processors", "run",
         "-b", bootstrap, "--data-dir", str(data_dir), "--app-id", app_id,
         "--group-timeout-s", str(timeout_s), "--tick-s", "0.5"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT)


@contextmanager
def worker_running(bootstrap: str, app_id: str, data_dir: Path, timeout_s: float = 600):
    """`start_worker`, SIGKILLed when the block ends."""
    worker = start_worker(bootstrap, app_id, data_dir, timeout_s)
    try:
        yield worker
    finally:
        worker.kill()
        worker.wait()


def produce(bootstrap: str, events: list[tuple[str, dict]]) -> None:
    producer = EventProducer(bootstrap)
    for schema, record in events:
        producer.produce(SCHEMA_TOPIC[schema], record["group_id"], record, schema)
    producer.close()


def wire(schema: str, record: dict) -> dict:
    """The record as a consumer reads it (Avro floats are 32-bit)."""
    return decode(encode(schema, record))[1]


def expected(events, settings: ProcessorSettings, timeout_at: int | None = None) -> list:
    state, outputs = None, []
    for schema, record in events:
        state, out = fold(state, schema, wire(schema, record), settings)
        outputs.extend(out)
    if timeout_at is not None:
        outputs.extend(expire(state, timeout_at, settings)[1])
    return [(e.topic.name, e.schema, wire(e.schema, e.record)) for e in outputs]


_readers: list["Reader"] = []


@pytest.fixture(autouse=True)
def _close_readers():
    """A reader left open after its test keeps retrying a broker the session has stopped (log noise)."""
    yield
    while _readers:
        _readers.pop().consumer.close()


class Reader:
    """Reads our run's records (by group id prefix) from output topics; keeps every copy it sees."""

    def __init__(self, bootstrap: str, run_id: str):
        _readers.append(self)
        self.run_id = run_id
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{run_id}",
                                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
        self.consumer.subscribe([TOPICS.samples.name, TOPICS.rewards.name, TOPICS.trajectories.name,
                                 TOPICS.dlq.name])
        self.seen: list[tuple[str, str, dict]] = []

    def poll_until(self, done, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while not done(self) and time.monotonic() < deadline:
            msg = self.consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            try:
                schema, record = decode(msg.value())
            except ValueError:
                continue
            mine = record.get("group_id", "").startswith(self.run_id) or (
                schema == "DeadLetter" and (record["key"] or b"").decode(errors="replace").startswith(self.run_id))
            if mine and (schema != "Reward" or record["source"] == "processors"):
                self.seen.append((msg.topic(), schema, record))
        assert done(self), f"timed out; saw {len(self.seen)} records: {[(s, r.get('group_id', r.get('key'))) for _, s, r in self.seen]}"

    def of(self, schema: str) -> list[dict]:
        return [r for _, s, r in self.seen if s == schema]

    def unique(self, schema: str) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for record in self.of(schema):
            assert out.setdefault(record["event_id"], record) == record, "same id, different content"
        return out


@pytest.mark.slow
def test_topology_matches_pure_functions(kafka_bootstrap, run_id, tmp_path):
    settings = ProcessorSettings(group_timeout_ms=15_000)
    t0 = now_ms()
    # Only g1 may time out: the others' events are stamped 10 minutes ahead, so a worker that starts late on a busy
    # machine cannot find them due (by wall time) while it is still reading them, and close them half-read.
    ahead = t0 + 600_000
    groups = {f"{run_id}-g{i}": group_events(f"{run_id}-g{i}", seq=i, group_size=3, start_ms=t0 if i == 1 else ahead)
              for i in range(3)}
    late = f"{run_id}-g1-s2"  # this session never finishes: its group closes on the timeout
    groups[f"{run_id}-g1"] = [e for e in groups[f"{run_id}-g1"]
                              if not (e[0] == "SessionFinished" and e[1]["session_id"] == late)]
    failed = f"{run_id}-g3"  # every session of this group fails: it closes at once without a sample
    groups[failed] = [e for e in group_events(failed, seq=3, group_size=2, start_ms=ahead)
                      if e[0] in ("Task", "SessionStarted")]
    groups[failed] += [("SessionFinished", {
        "event_id": f"finish-{sid}", "event_time": ahead + 50, "group_id": failed, "task_id": f"task-{failed}",
        "session_id": sid, "status": "error", "num_completions": 0, "num_tool_spans": 0, "reason": "crashed"})
        for sid in (f"{failed}-s0", f"{failed}-s1")]
    events = [e for evs in groups.values() for e in evs]
    bad = events[5][1]
    produce(kafka_bootstrap, events)
    producer = EventProducer(kafka_bootstrap)
    producer.produce_raw(TOPICS.completions.name, bad["group_id"].encode(), b"not avro")
    producer.produce(TOPICS.completions, bad["group_id"], {**next(r for s, r in events if s == "Completion"
                                                                  and r["trainable"]),
                                                           "completion_logprobs": [0.0]})
    producer.close()

    want = []
    for gid, evs in groups.items():
        last = max(r["event_time"] for _, r in evs)  # an idle group is cut this long after its last event
        want += expected(evs, settings, timeout_at=last + settings.group_timeout_ms if gid.endswith("g1") else None)
    want_ids = {r["event_id"] for _, _, r in want}

    with worker_running(kafka_bootstrap, f"proc-{run_id}", tmp_path / "worker", settings.group_timeout_ms / 1000):
        reader = Reader(kafka_bootstrap, run_id)
        reader.poll_until(lambda r: want_ids <= {rec["event_id"] for _, _, rec in r.seen} and len(r.of("DeadLetter")) >= 2)

    samples = reader.unique("TrainSample")
    assert sorted(samples.values(), key=lambda r: r["group_id"]) == [r for _, s, r in want if s == "TrainSample"]
    assert [s["group_complete"] for s in sorted(samples.values(), key=lambda r: r["group_id"])] == [True, False, True]
    [skipped] = reader.unique("GroupSkipped").values()
    assert [skipped] == [r for _, s, r in want if s == "GroupSkipped"] and skipped["group_id"] == failed
    assert reader.unique("Reward") == {r["event_id"]: r for _, s, r in want if s == "Reward"}
    assert reader.unique("Trajectory") == {r["event_id"]: r for _, s, r in want if s == "Trajectory"}
    dead = reader.of("DeadLetter")
    assert {d["value"] for d in dead if d["value"] == b"not avro"} == {b"not avro"}
    assert any("logprobs" in d["error"] for d in dead)
    assert all(d["rejected_by"] == "processors.groups" and d["topic"] == TOPICS.completions.name for d in dead)


@pytest.mark.slow
def test_a_worker_behind_reads_its_backlog_before_it_times_groups_out(kafka_bootstrap, run_id, tmp_path):
    """Groups recorded long ago, read by a new worker (an outage longer than the group timeout, or a new app id on
    topics that hold records): their deadlines passed before the worker read a record of them. It still folds each
    group whole before timing anything out: every complete group yields its complete sample and nothing is
    skipped; the one group with an unfinished session closes on its timeout with the two sessions that finished."""
    settings = ProcessorSettings(group_timeout_ms=15_000)
    long_ago = now_ms() - 20 * 60_000  # past every deadline; closed markers are kept an hour
    groups = {f"{run_id}-b{i}": group_events(f"{run_id}-b{i}", seq=i, group_size=3, turns=2,
                                              start_ms=long_ago + 100 * i) for i in range(40)}
    unfinished = f"{run_id}-b7-s1"
    groups[f"{run_id}-b7"] = [e for e in groups[f"{run_id}-b7"]
                              if not (e[0] == "SessionFinished" and e[1]["session_id"] == unfinished)]
    produce(kafka_bootstrap, [e for evs in groups.values() for e in evs])
    want = {}
    for gid, evs in groups.items():
        last = max(r["event_time"] for _, r in evs)
        timeout_at = last + settings.group_timeout_ms if gid.endswith("-b7") else None
        want.update({r["group_id"]: r for _, s, r in expected(evs, settings, timeout_at) if s == "TrainSample"})

    timeout_s = settings.group_timeout_ms / 1000
    with worker_running(kafka_bootstrap, f"proc-behind-{run_id}", tmp_path / "worker", timeout_s):
        reader = Reader(kafka_bootstrap, run_id)
        reader.poll_until(lambda r: len(r.unique("TrainSample")) + len(r.unique("GroupSkipped")) >= len(groups),
                          timeout=180)

    assert reader.unique("GroupSkipped") == {}
    samples = {s["group_id"]: s for s in reader.unique("TrainSample").values()}
    assert sorted(samples) == sorted(want)
    incomplete = sorted(g for g, s in samples.items() if not s["group_complete"])
    assert incomplete == [f"{run_id}-b7"], f"closed before they were read whole: {incomplete}"
    assert samples == want


@pytest.mark.slow
def test_sigkill_and_restart_yield_one_identical_sample_per_group(kafka_bootstrap, run_id, tmp_path):
    settings = ProcessorSettings(group_timeout_ms=600_000)
    t0 = now_ms()
    groups = {f"{run_id}-k{i}": group_events(f"{run_id}-k{i}", seq=i, group_size=3, turns=3, start_ms=t0)
              for i in range(6)}
    early = [e for i, evs in enumerate(groups.values()) for e in (evs if i < 3 else evs[: len(evs) // 2])]
    rest = [e for i, evs in enumerate(groups.values()) if i >= 3 for e in evs[len(evs) // 2:]]
    produce(kafka_bootstrap, early)
    app_id, data_dir = f"proc-kill-{run_id}", tmp_path / "worker"
    reader = Reader(kafka_bootstrap, run_id)

    with worker_running(kafka_bootstrap, app_id, data_dir):  # SIGKILLed once a group is out
        reader.poll_until(lambda r: len(r.unique("TrainSample")) >= 1)
    produce(kafka_bootstrap, rest)
    with worker_running(kafka_bootstrap, app_id, data_dir):
        reader.poll_until(lambda r: len(r.unique("TrainSample")) == 6)

    samples = reader.unique("TrainSample")  # asserts that every copy of an id has the same content
    assert sorted(s["group_id"] for s in samples.values()) == sorted(groups)
    want = {r["group_id"]: r for evs in groups.values() for _, s, r in expected(evs, settings) if s == "TrainSample"}
    assert {s["group_id"]: s for s in samples.values()} == want


def _members(admin, app_id: str) -> list[int]:
    """How many partitions each member of the worker group holds (empty while it is not stable)."""
    try:
        [future] = admin.describe_consumer_groups([app_id]).values()
        group = future.result(timeout=10)
    except Exception:  # the group does not exist yet, or its coordinator is loading
        return []
    if group.state.name != "STABLE":
        return []
    return [len(m.assignment.topic_partitions) for m in group.members]


@pytest.mark.slow
def test_two_workers_share_the_partitions_and_one_takes_over_when_the_other_is_killed(kafka_bootstrap, run_id,
                                                                                      tmp_path):
    """Two workers of one group split the partitions; SIGKILL one with groups half-folded in its tables, and the
    other takes its partitions over, restoring those tables from their changelogs: every group still yields
    exactly one sample, equal to what one worker computes (the pure fold)."""
    settings = ProcessorSettings(group_timeout_ms=600_000)
    t0 = now_ms()
    groups = {f"{run_id}-w{i}": group_events(f"{run_id}-w{i}", seq=i, group_size=3, turns=3, start_ms=t0)
              for i in range(8)}
    early = [e for i, evs in enumerate(groups.values()) for e in (evs if i < 2 else evs[: len(evs) // 2])]
    rest = [e for i, evs in enumerate(groups.values()) if i >= 2 for e in evs[len(evs) // 2:]]
    produce(kafka_bootstrap, early)
    from confluent_kafka.admin import AdminClient

    app_id, admin = f"proc-two-{run_id}", AdminClient({"bootstrap.servers": kafka_bootstrap})
    reader = Reader(kafka_bootstrap, run_id)
    first = start_worker(kafka_bootstrap, app_id, tmp_path / "first", 600)
    second = start_worker(kafka_bootstrap, app_id, tmp_path / "second", 600)
    try:
        deadline = time.monotonic() + 120
        while not (len(held := _members(admin, app_id)) == 2 and all(held)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(held) == 2 and all(held), f"the two workers did not share the partitions: {held}"
        reader.poll_until(lambda r: len(r.unique("TrainSample")) >= 2)  # the early-complete groups
        first.send_signal(signal.SIGKILL)
        first.wait()
        produce(kafka_bootstrap, rest)
        reader.poll_until(lambda r: len(r.unique("TrainSample")) == len(groups), timeout=180)
        assert second.poll() is None
        taken_over = _members(admin, app_id)
    finally:
        for worker in (first, second):
            worker.kill()
            worker.wait()

    assert taken_over == [sum(held)], "the surviving worker holds every partition"
    samples = reader.unique("TrainSample")  # asserts that every copy of an id has the same content
    assert sorted(s["group_id"] for s in samples.values()) == sorted(groups)
    want = {r["group_id"]: r for evs in groups.values() for _, s, r in expected(evs, settings) if s == "TrainSample"}
    assert {s["group_id"]: s for s in samples.values()} == want


@pytest.mark.slow
@pytest.mark.parametrize("which", ["followed", "last"])
def test_a_record_the_consumer_skipped_is_read_back_from_kafka_and_folded(kafka_bootstrap, run_id, tmp_path, which):
    """faust 0.15 can drop a prefetched record when a rebalance hands its partition over, and acknowledge it, so the
    committed offset passes a record that was never folded (in the two-worker test, a group then waits forever for
    one completion). Its effect is reproduced here exactly: the worker's committed offset is moved past a completion
    it never read. On restart the worker reads the skipped one back from Kafka and folds it: the group yields the
    sample the pure fold computes. `followed`: later records of that partition show the gap to the groups agent;
    `last`: none does (the committed offset is the partition's end), and the read-marks sweep finds it."""
    from confluent_kafka import TopicPartition

    settings = ProcessorSettings(group_timeout_ms=600_000)
    gid = f"{run_id}-skip"
    events = group_events(gid, seq=0, group_size=3, turns=3, start_ms=now_ms())
    cut = next(i for i, (schema, r) in enumerate(events) if schema == "Completion" and r["session_id"].endswith("s1"))
    early, rest = events[:cut], events[cut:]
    produce(kafka_bootstrap, early)
    app_id, data_dir = f"proc-skip-{run_id}", tmp_path / "worker"
    inputs = [(t.name, p) for t in (TOPICS.tasks, TOPICS.sessions, TOPICS.completions, TOPICS.tool_spans,
                                    TOPICS.rewards) for p in range(TOPICS.completions.partitions)]
    probe = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"probe-{run_id}"})
    ends = {tp: probe.get_watermark_offsets(TopicPartition(*tp), timeout=10)[1] for tp in inputs}
    probe.close()

    worker = start_worker(kafka_bootstrap, app_id, data_dir, 600)
    def behind(committed: dict) -> dict:  # (its own outputs to forge.rewards come after the ends: more to read)
        return {tp: (committed[tp][0], end) for tp, end in ends.items() if (committed[tp][0] or 0) < end}

    try:  # until it folded and committed everything there was
        deadline = time.monotonic() + 120
        while (late := behind(partition_positions(kafka_bootstrap, app_id, inputs))) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not late, f"the worker did not commit what it read (committed, end): {late}"
    finally:
        worker.terminate()
        worker.wait(30)

    delivered: list[tuple[str, int, int, str]] = []
    producer = EventProducer(kafka_bootstrap)
    for schema, record in rest:
        producer.produce(SCHEMA_TOPIC[schema], gid, record, schema, on_delivery=lambda err, msg, s=schema: (
            delivered.append((msg.topic(), msg.partition(), msg.offset(), s))))
    producer.close()
    completions = [d for d in delivered if d[3] == "Completion"]
    skipped = completions[0] if which == "followed" else completions[-1]
    follow = sum(1 for d in delivered if d[:2] == skipped[:2] and d[2] > skipped[2])
    assert follow >= 2 if which == "followed" else follow == 0
    mover = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": app_id, "enable.auto.commit": False})
    mover.commit(offsets=[TopicPartition(skipped[0], skipped[1], skipped[2] + 1)], asynchronous=False)
    mover.close()

    reader = Reader(kafka_bootstrap, run_id)
    with worker_running(kafka_bootstrap, app_id, data_dir):
        reader.poll_until(lambda r: len(r.unique("TrainSample")) == 1)
    [sample] = reader.unique("TrainSample").values()
    [want] = [r for _, s, r in expected(events, settings) if s == "TrainSample"]
    assert sample == want
    log = (tmp_path / f"{app_id}.log").read_text(errors="replace")
    # `followed`: that one record; `last`: the records moved past, up to it
    first = skipped[2] if which == "followed" else min(d[2] for d in delivered if d[:2] == skipped[:2])
    why = "skipped" if which == "followed" else "skipped or did not deliver"  # the groups agent / the sweep
    assert f"{skipped[0]}[{skipped[1]}]: the consumer {why} offsets {first} to {skipped[2]} " in log
