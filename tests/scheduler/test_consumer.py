"""The windowed consumer on the real broker: window order, offsets, timeouts, staleness, SIGKILL and restart."""

import base64
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from forge_stream.events import now_ms
from forge_stream.kafka.consumer import consumer_config, dead_letter
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.reader import PartitionReader
from forge_stream.scheduler.consumer import (
    SchedulerSettings, WindowedConsumer, start_at_end,
)
from forge_stream.scheduler.window import WindowSpec
from forge_stream.topics import TOPICS
from scheduler_records import group_id, sample, skipped, task

pytestmark = pytest.mark.kafka
CHILD = Path(__file__).with_name("scheduler_child.py")


class CountingTrainer:
    def __init__(self):
        self.policy_version = 0
        self.batches = []

    def train(self, batch):
        self.batches.append(batch)
        self.policy_version += 1
        return {"loss": 1.0}


def settings_for(bootstrap, run, **kw):
    settings = SchedulerSettings(bootstrap=bootstrap, run=run, **kw)
    start_at_end(settings)
    return settings


def produce(bootstrap, tasks=(), samples=()):
    producer = EventProducer(bootstrap)
    for record in tasks:
        producer.produce(TOPICS.tasks, record["group_id"], record)
    for record in samples:
        producer.produce(TOPICS.samples, record["group_id"], record)
    producer.close()


def trained_groups(bootstrap, run):
    return [g for e in read_slice(bootstrap, TOPICS.train_metrics, Slice()) if e.key == run
            for g in e.record["group_ids"]]


def committed(bootstrap, group, topic):
    consumer = Consumer(consumer_config(bootstrap, group))
    try:
        parts = [TopicPartition(topic.name, p) for p in range(topic.partitions)]
        got = {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic.name, p), timeout=10)[1]
                for p in range(topic.partitions)}
        return got, ends
    finally:
        consumer.close()


def uncommitted_samples(bootstrap, group, run):
    """Per partition of forge.samples, the groups of `run` whose samples lie past the scheduler's committed offset,
    in offset order (other runs' records, which other tests on a shared broker may write meanwhile, are left out)."""
    got, ends = committed(bootstrap, group, TOPICS.samples)
    reader = PartitionReader(bootstrap)
    try:
        return {p: [record["group_id"] for _, _, _, record in reader.read(TOPICS.samples, p, max(got[p], 0), ends[p])
                    if record["group_id"].startswith(run)] for p in ends}
    finally:
        reader.close()


def commits_stop_at(held, per_partition):
    """Each partition is committed up to its first held record, not past it and not short of it: what lies past
    the commit starts with a held sample (a consumed sample written after a held one on its partition waits)."""
    return all(not groups or groups[0] in held for groups in per_partition.values()) \
        and held <= {g for groups in per_partition.values() for g in groups}


def test_window_hides_finished_groups_beyond_it_and_commits_only_consumed(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=3))
    produce(kafka_bootstrap, [task(run_id, s) for s in range(8)], [sample(run_id, s) for s in (1, 2, 3, 4, 5)])
    consumer, trainer = WindowedConsumer(settings), CountingTrainer()
    steps = consumer.run(trainer, steps=3, wait_s=5)
    assert [r["group_ids"] for r in steps] == [[group_id(run_id, 1), group_id(run_id, 2)]]
    produce(kafka_bootstrap, samples=[sample(run_id, 0)])
    steps = consumer.run(trainer, steps=1, wait_s=10)
    assert steps[0]["group_ids"] == [group_id(run_id, 0), group_id(run_id, 3)]
    unconsumed = {group_id(run_id, 4), group_id(run_id, 5)}
    left = uncommitted_samples(kafka_bootstrap, settings.name, run_id)
    assert commits_stop_at(unconsumed, left), f"commits stop at the unconsumed samples (4, 5): {left}"
    assert consumer.run(trainer, steps=1, wait_s=10)[0]["group_ids"] == [group_id(run_id, 4), group_id(run_id, 5)]
    assert consumer.next_batch(trainer.policy_version, 0.5, partial=True) is None
    assert not any(uncommitted_samples(kafka_bootstrap, settings.name, run_id).values()), "all consumed: all committed"
    produce(kafka_bootstrap, samples=[sample(run_id, 6)])
    assert consumer.next_batch(trainer.policy_version, 5, partial=True).group_ids == [group_id(run_id, 6)]
    consumer.close()


def test_timeout_skips_a_group_that_never_finishes_and_records_it(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=1),
                            group_timeout_s=2.0)
    submitted = time.monotonic()  # the clock starts at the Task's event time
    produce(kafka_bootstrap, [task(run_id, s) for s in range(3)], [sample(run_id, s) for s in (1, 2)])
    consumer = WindowedConsumer(settings)
    steps = consumer.run(CountingTrainer(), steps=1, wait_s=20)
    assert time.monotonic() - submitted >= 1.9
    assert steps[0]["group_ids"] == [group_id(run_id, 1), group_id(run_id, 2)]
    assert consumer.skipped == [group_id(run_id, 0)]
    letters = [e.record for e in read_slice(kafka_bootstrap, TOPICS.dlq, Slice()) if e.key == group_id(run_id, 0)]
    assert len(letters) == 1 and letters[0]["topic"] == TOPICS.tasks.name
    assert letters[0]["rejected_by"] == settings.name and "forge.trajectories" in letters[0]["error"]
    consumer.close()
    restarted = WindowedConsumer(settings)
    assert group_id(run_id, 0) in restarted.retired
    restarted.close()


@pytest.mark.parametrize("action", ["keep", "drop"])
def test_staleness_is_reported_and_bounded(kafka_bootstrap, run_id, action):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=4),
                            max_staleness=3, stale_action=action)
    versions = {0: 9, 1: 5, 2: 8, 3: 7}
    produce(kafka_bootstrap, [task(run_id, s) for s in range(4)], [sample(run_id, s, v) for s, v in versions.items()])
    consumer, trainer = WindowedConsumer(settings), CountingTrainer()
    trainer.policy_version = 10
    steps = consumer.run(trainer, steps=1, wait_s=10)
    if action == "keep":
        assert steps[0]["staleness_max"] == 5 and steps[0]["staleness_mean"] == 3.0
        assert trainer.batches[0].over_bound == 1
    else:
        assert consumer.dropped == [group_id(run_id, 1)]
        assert steps[0]["group_ids"] == [group_id(run_id, 0), group_id(run_id, 2)]
        assert steps[0]["staleness_max"] == 2
    consumer.close()


def _start_child(bootstrap, run, total, batch, *mode):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), str(CHILD.parent)]))
    return subprocess.Popen([sys.executable, str(CHILD), bootstrap, run, str(total), str(batch), *mode], env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["external", "after-publish", "external-with-garbage"])
def test_sigkill_and_restart_lose_nothing_and_train_nothing_twice(kafka_bootstrap, run_id, kill):
    total, batch = 24, 4
    settings = settings_for(kafka_bootstrap, run_id, batch_size=batch)
    finish_order = list(range(total))
    random.Random(run_id).shuffle(finish_order)
    produce(kafka_bootstrap, [task(run_id, s) for s in range(total)], [sample(run_id, s) for s in finish_order])
    if kill == "external-with-garbage":  # undecodable records behind groups of every partition, both topics
        producer = EventProducer(kafka_bootstrap)
        for s in range(0, total, 3):
            for topic in (TOPICS.tasks, TOPICS.samples):
                producer.produce_raw(topic.name, group_id(run_id, s).encode(), b"not avro")
        producer.close()
    if kill.startswith("external"):
        child = _start_child(kafka_bootstrap, run_id, total, batch)
        deadline = time.monotonic() + 60
        while len(trained_groups(kafka_bootstrap, run_id)) < 2 * batch and time.monotonic() < deadline:
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    else:
        child = _start_child(kafka_bootstrap, run_id, total, batch, "die-after-publish")
        assert child.wait(90) == -signal.SIGKILL
    before = trained_groups(kafka_bootstrap, run_id)
    assert 0 < len(before) < total
    assert _start_child(kafka_bootstrap, run_id, total, batch).wait(120) == 0
    trained = trained_groups(kafka_bootstrap, run_id)
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(trained) == {group_id(run_id, s) for s in range(total)}, "a group was lost"
    for topic in (TOPICS.tasks, TOPICS.samples):
        got, ends = committed(kafka_bootstrap, settings.name, topic)
        assert got == ends, f"{topic.name}: everything consumed is committed"


def test_an_invalid_sample_goes_to_the_dlq_and_its_group_is_skipped(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=1))
    produce(kafka_bootstrap, [task(run_id, s) for s in range(3)], [sample(run_id, s) for s in range(3)])

    def validate(record):
        if record["group_id"] == group_id(run_id, 0):
            raise ValueError("token id 99999 is outside the model's vocabulary")

    consumer = WindowedConsumer(settings, validate=validate)
    steps = consumer.run(CountingTrainer(), steps=1, wait_s=20)
    assert steps[0]["group_ids"] == [group_id(run_id, 1), group_id(run_id, 2)]  # not blocked behind group 0
    letters = [e.record for e in read_slice(kafka_bootstrap, TOPICS.dlq, Slice()) if e.key == group_id(run_id, 0)]
    assert len(letters) == 1 and letters[0]["topic"] == TOPICS.samples.name
    assert "invalid TrainSample: token id 99999" in letters[0]["error"]
    consumer.close()
    restarted = WindowedConsumer(settings)
    assert group_id(run_id, 0) in restarted.retired
    restarted.close()


def test_old_tasks_get_the_whole_timeout_from_when_they_are_published(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1), group_timeout_s=30)
    long_ago = [{**task(run_id, s), "event_time": 1_600_000_000_000} for s in range(2)]  # back-filled tasks
    produce(kafka_bootstrap, long_ago, [sample(run_id, 1)])
    consumer = WindowedConsumer(settings)
    assert consumer.next_batch(0, 3, partial=True) is None  # group 0 blocks the window, but is not skipped yet
    assert consumer.skipped == []
    produce(kafka_bootstrap, samples=[sample(run_id, 0)])
    assert consumer.next_batch(0, 10).group_ids == [group_id(run_id, 0)]
    consumer.close()


def letters_for(bootstrap, group):
    return [e.record for e in read_slice(bootstrap, TOPICS.dlq, Slice()) if e.key == group]


def test_a_dead_letter_never_commits_past_an_untrained_group(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=1))
    produce(kafka_bootstrap, [task(run_id, 0), task(run_id, 1)], [sample(run_id, 1)])
    producer = EventProducer(kafka_bootstrap)  # garbage behind the Task of group 0 and the sample of group 1
    producer.produce_raw(TOPICS.tasks.name, group_id(run_id, 0).encode(), b"not avro")
    producer.produce_raw(TOPICS.samples.name, group_id(run_id, 1).encode(), b"\x00garbage")
    producer.close()
    consumer = WindowedConsumer(settings)
    deadline = time.monotonic() + 30
    while consumer._source.dead_letters < 2 and time.monotonic() < deadline:
        consumer.poll(0.5)
    assert consumer._source.dead_letters == 2
    assert consumer.next_batch(0, 1, partial=True) is None  # group 1 waits behind group 0 (window 1)
    consumer.commit()
    consumer.close()  # the trainer dies here: nothing of groups 0 and 1 is trained yet

    produce(kafka_bootstrap, samples=[sample(run_id, 0)])
    restarted = WindowedConsumer(settings)
    steps = restarted.run(CountingTrainer(), steps=1, wait_s=20)
    assert [s["group_ids"] for s in steps] == [[group_id(run_id, 0), group_id(run_id, 1)]]
    restarted.close()
    for topic in (TOPICS.tasks, TOPICS.samples):
        got, ends = committed(kafka_bootstrap, settings.name, topic)
        assert got == ends, f"{topic.name}: the dead letters are committed once the groups before them trained"


def test_a_group_skipped_upstream_is_retired_at_once(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=1))
    produce(kafka_bootstrap, [task(run_id, s) for s in range(3)], [sample(run_id, s) for s in (1, 2)])
    producer = EventProducer(kafka_bootstrap)
    producer.produce(TOPICS.samples, group_id(run_id, 0), skipped(run_id, 0), "GroupSkipped")
    producer.close()
    consumer = WindowedConsumer(settings)  # group_timeout_s is 600: only the GroupSkipped can unblock the window
    steps = consumer.run(CountingTrainer(), steps=1, wait_s=20)
    assert [s["group_ids"] for s in steps] == [[group_id(run_id, 1), group_id(run_id, 2)]]
    assert consumer.skipped == [group_id(run_id, 0)]
    [letter] = letters_for(kafka_bootstrap, group_id(run_id, 0))
    assert letter["topic"] == TOPICS.samples.name and letter["rejected_by"] == settings.name
    assert "skipped by the processors: no trainable completion" in letter["error"]
    consumer.close()
    restarted = WindowedConsumer(settings)
    assert group_id(run_id, 0) in restarted.retired
    restarted.close()


def test_a_task_the_processors_reject_is_never_queued(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1))
    produce(kafka_bootstrap, [{**task(run_id, 0), "group_size": 0}, task(run_id, 1)], [sample(run_id, 1)])
    consumer = WindowedConsumer(settings)
    steps = consumer.run(CountingTrainer(), steps=1, wait_s=20)
    assert [s["group_ids"] for s in steps] == [[group_id(run_id, 1)]]
    assert consumer.skipped == [group_id(run_id, 0)]
    [letter] = letters_for(kafka_bootstrap, group_id(run_id, 0))
    assert letter["topic"] == TOPICS.tasks.name and "invalid Task" in letter["error"]
    assert "group_size 0" in letter["error"]
    consumer.close()


def test_the_group_timeout_goes_on_across_a_restart(kafka_bootstrap, run_id):
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1), group_timeout_s=6)
    submitted = time.monotonic()
    produce(kafka_bootstrap, [task(run_id, 0), task(run_id, 1)], [sample(run_id, 1)])
    consumer = WindowedConsumer(settings)
    assert consumer.next_batch(0, 3, partial=True) is None and consumer.skipped == []
    consumer.close()  # the trainer dies with group 0 waited for about half its timeout
    restarted = WindowedConsumer(settings)
    started = time.monotonic()
    assert restarted.next_batch(0, 20).group_ids == [group_id(run_id, 1)]
    assert restarted.skipped == [group_id(run_id, 0)]
    assert time.monotonic() - submitted >= 5.9, "skipped before its timeout"
    assert time.monotonic() - started < 5, "the clock started again at the restart"
    restarted.close()


def session_event(run, seq, n):
    """A SessionStarted of group `seq`: an event on the processors' inputs that the consumer does not read."""
    return {"event_id": f"{run}-start-{seq}-{n}", "event_time": now_ms(), "session_id": f"{run}-s{n}",
            "group_id": group_id(run, seq), "task_id": f"t{seq}", "base_url": "http://gateway/s/x/v1", "metadata": {}}


def test_a_group_whose_events_keep_coming_is_not_skipped_however_long_it_runs(kafka_bootstrap, run_id):
    """The timeout is idle time, as the processors': group 0 runs for more than twice the timeout with an event every
    second, so it is not skipped at its Task's time plus the timeout, but only once it goes quiet."""
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1), group_timeout_s=4)
    produce(kafka_bootstrap, [task(run_id, 0), task(run_id, 1)], [sample(run_id, 1)])
    submitted = time.monotonic()
    last = {}

    def keep_busy():
        producer = EventProducer(kafka_bootstrap)
        for n in range(9):
            producer.send_sync(TOPICS.sessions, group_id(run_id, 0), session_event(run_id, 0, n), "SessionStarted")
            last["at"] = time.monotonic()
            time.sleep(1)
        producer.close()

    busy = threading.Thread(target=keep_busy)
    busy.start()
    consumer = WindowedConsumer(settings)
    assert consumer.next_batch(0, 9) is None, "group 0 was skipped while its events kept coming"
    assert consumer.skipped == [] and time.monotonic() - submitted >= 8.9
    busy.join()
    assert consumer.next_batch(0, 20).group_ids == [group_id(run_id, 1)]
    assert consumer.skipped == [group_id(run_id, 0)]
    assert time.monotonic() - last["at"] >= 3.9, "skipped before it had been idle for the timeout"
    [letter] = letters_for(kafka_bootstrap, group_id(run_id, 0))
    assert "no event of the group for 4s" in letter["error"]
    consumer.close()


def test_strict_fifo_holds_from_the_first_batch_whatever_partition_is_read_first(kafka_bootstrap, run_id):
    """Tasks and samples are keyed by group, so they spread over partitions; a consumer that has read one partition
    but not yet another must not hand out a younger group whose older neighbour's Task it has not seen. (Otherwise
    the restart test above can hand out group 1 after the restart before group 0's Task is read, and group 0 is
    then neither queued nor skipped.)"""
    n = 24
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1))
    # A backlog ahead of group 0's Task on its partition (big Tasks of groups this scheduler already retired), so
    # that partition takes several fetches while the others arrive in the first.
    producer = EventProducer(kafka_bootstrap)
    for i in range(4):
        filler = f"{run_id}-filler{i}"
        big = {**task(run_id, 1000 + i), "group_id": filler,
               "prompt_json": json.dumps({"blob": base64.b64encode(os.urandom(500_000)).decode()})}
        producer.produce(TOPICS.tasks, group_id(run_id, 0), big)  # keyed like group 0: the same partition
        producer.produce(TOPICS.dlq, filler, dead_letter(TOPICS.tasks.name, 0, i, None, None, "test backlog",
                                                         settings.name))
    producer.close()
    produce(kafka_bootstrap, [task(run_id, s) for s in range(n)], [sample(run_id, s) for s in range(n)])
    for attempt in range(3):  # each consumer starts from the committed offsets: nothing trained, all re-read
        consumer = WindowedConsumer(settings)
        first = consumer.next_batch(0, 20)
        assert first.group_ids == [group_id(run_id, 0)], f"attempt {attempt}: {first.group_ids} handed out first"
        consumer.close()
    consumer, trainer = WindowedConsumer(settings), CountingTrainer()
    steps = consumer.run(trainer, steps=n, wait_s=20)
    assert [r["group_ids"][0] for r in steps] == [group_id(run_id, s) for s in range(n)]
    consumer.close()


def test_a_sample_claim_is_redeemed_when_handed_over_and_a_lost_payload_skips_its_group(kafka_bootstrap, run_id,
                                                                                         tmp_path):
    """A TrainSample too large for Kafka comes as a SampleClaim (forge_stream.events.claims): the trainer gets the
    whole sample; a claim whose payload is gone is dead-lettered and its group skipped, without blocking others."""
    from forge_stream.events import decode, encode
    from forge_stream.events.claims import ClaimStore, claim_record

    settings = settings_for(kafka_bootstrap, run_id, batch_size=2, window=WindowSpec(count=3))
    store = ClaimStore(str(tmp_path / "claims"))
    big = {**sample(run_id, 0), "token_ids": [7, 8, 9, 10]}
    lost = sample(run_id, 1)
    claims = [claim_record(big, store.put(encode("TrainSample", big))),
              claim_record(lost, store.put(encode("TrainSample", lost)))]
    for path in (tmp_path / "claims").rglob("*"):
        if path.is_file() and path.name == claims[1]["sha256"]:
            path.unlink()
    producer = EventProducer(kafka_bootstrap)
    for s in range(3):
        producer.produce(TOPICS.tasks, group_id(run_id, s), task(run_id, s))
    for record in claims:
        producer.produce(TOPICS.samples, record["group_id"], record, "SampleClaim")
    producer.produce(TOPICS.samples, group_id(run_id, 2), sample(run_id, 2))
    producer.close()
    checked = []
    consumer, trainer = WindowedConsumer(settings, validate=checked.append), CountingTrainer()
    steps = consumer.run(trainer, steps=1, wait_s=20)
    assert steps[0]["group_ids"] == [group_id(run_id, 0), group_id(run_id, 2)]
    assert trainer.batches[0].samples[0] == decode(encode("TrainSample", big))[1]  # the whole sample, as on the wire
    assert {r["group_id"] for r in checked} == {group_id(run_id, 0), group_id(run_id, 2)}  # validated when redeemed
    [letter] = letters_for(kafka_bootstrap, group_id(run_id, 1))
    assert "claimed TrainSample unavailable" in letter["error"] and consumer.skipped == [group_id(run_id, 1)]
    consumer.close()


def test_a_window_that_waits_says_on_which_group_and_what_it_misses(kafka_bootstrap, run_id, tmp_path, monkeypatch,
                                                                   caplog):
    """The head has one session finished, one open, none more: the trainer's log and `status` (text and --json,
    key `window`) name the group, what it misses and when it is skipped; the view goes once the consumer stops."""
    from forge_stream.processors.synthetic import group_events
    from forge_stream.scheduler import consumer as consumer_module, report

    monkeypatch.setattr(report, "WAIT_SAY_S", 1.0)
    monkeypatch.setattr(consumer_module, "VIEW_EVERY_S", 0.5)
    home = tmp_path / "home"
    view_path = report.view_file(home / "run", run_id)
    settings = settings_for(kafka_bootstrap, run_id, batch_size=1, window=WindowSpec(count=1), view_path=view_path)
    head = group_id(run_id, 0)
    produce(kafka_bootstrap, [task(run_id, 0), task(run_id, 1)], [sample(run_id, 1)])
    lifecycle = [(s, r) for s, r in group_events(head, group_size=2, start_ms=now_ms())
                 if s == "SessionStarted" or (s == "SessionFinished" and r["session_id"].endswith("-s0"))]
    producer = EventProducer(kafka_bootstrap)
    for schema, record in lifecycle:
        producer.produce(TOPICS.sessions, head, record, schema)
    producer.close()

    consumer = WindowedConsumer(settings)
    with caplog.at_level("INFO", logger="forge_stream.scheduler.consumer"):
        assert consumer.next_batch(0, wait_s=4) is None  # the head blocks the window (W=1)
    said = [r.getMessage() for r in caplog.records if "waiting for a batch" in r.getMessage()]
    assert said and f"waits on group {head} (task t0)" in said[-1], caplog.text
    assert "missing its sample: 1 of its 2 sessions finished (1 open, 0 never opened)" in said[-1]
    assert "1 finished groups wait behind it; the trainer skips it in" in said[-1]

    env = {**os.environ, "FORGE_HOME": str(home)}
    status = subprocess.run([sys.executable, "-m", "forge_stream", "status", "--json", "-b", kafka_bootstrap],
                            env=env, capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr[-3000:]
    window = json.loads(status.stdout)["window"][run_id]
    assert window["head"]["group_id"] == head and window["head"]["sessions"] == {"started": 2, "finished": 1}
    assert window["trainer_running"] and window["held"] == 1 and window["head"]["skip_at_ms"] > now_ms()
    text = subprocess.run([sys.executable, "-m", "forge_stream", "status", "-b", kafka_bootstrap], env=env,
                          capture_output=True, text=True, timeout=120)
    assert f"windowed FIFO of run {run_id}: the window (1 groups) waits on group {head}" in text.stdout, text.stdout
    consumer.close()
    assert not view_path.exists()


def test_the_window_s_line_says_the_head_what_it_misses_and_when_it_is_skipped():
    import doctest

    from forge_stream.scheduler import report

    result = doctest.testmod(report)
    assert result.attempted >= 5 and result.failed == 0
