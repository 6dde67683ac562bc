"""The Kafka adapter of the windowed FIFO: forge.tasks + forge.samples in, batches to the trainer out.

It learns the queue from Task events (`seq`) and the finished groups from TrainSample events (`task_seq`) or
their SampleClaims (a sample too large for Kafka, forge_stream.events.claims: redeemed when handed over, so a
held claim costs its header only), holds finished samples until the window reaches them, and hands the trainer batches through
`WindowedFifo` (forge_stream.scheduler.window).

Durability. Kafka offsets are one watermark per partition, and groups are consumed out of order, so the
consumer commits on each partition only up to the first record whose group is not yet *retired* (trained,
skipped or dropped). What lies beyond the watermark is re-read after a restart, so the retired groups must
be known durably on their own:
- a trained group is listed in the `group_ids` of the TrainStep this loop publishes on forge.train_metrics
  (keyed by the run name) before it commits any offset: that record is the commit point of a step;
- a skipped group becomes a DeadLetter on forge.dlq (rejected_by = `scheduler:<run>`, key = group id) with the
  original bytes of what decided it: the Task of a group that timed out or that the processors would reject
  (group_size < 1), the GroupSkipped the processors published for a group that closed without a sample, the
  TrainSample the trainer cannot use or that the staleness bound dropped.
On start the consumer reads both topics to the end and retires those groups again, so after a SIGKILL
nothing is lost (uncommitted records are re-read) and nothing is trained twice (retired groups are skipped).
A record that cannot be decoded goes to forge.dlq too (DecodingConsumer) and is settled at once, but the
watermark passes it only with everything before it: a dead letter never commits past an untrained group.

Skips. The window never waits on a group that cannot come: a GroupSkipped (forge.samples) retires its group at
once, and the processors publish one when they cut a group that went idle (no event for their group timeout) or
outgrew its size bound. The consumer's own timeout is a backstop for a group the processors never close (they are
down, or lost it): the group blocking the window is skipped once `group_timeout_s` passed with no event of it, the
same idle rule as the processors'. The consumer reads only the Task and the sample of a group, so when that much
time has passed since the last event it saw, it looks for later ones: it reads the group's partition of the
processors' other inputs (sessions, completions, tool spans, rewards) from that time on (`group_activity`), and the
clock starts again at the latest it finds. A group whose events keep coming is never skipped, however long it
runs. Times are the events' own (event time, or when written to Kafka if later) and all come from Kafka, so a
restart does not restart the clock. The default (900 s) is above the processors' (600 s), so with both at their
defaults the processors' cut comes first.

Order. Nothing is handed out before the consumer has read each partition it holds up to its end since it was
assigned: Tasks and samples are keyed by group, so an older group's Task may sit in a partition that is read
after a younger group's Task and sample, and handing the younger one out first would break the FIFO (and, after
a restart, leave the older group neither queued nor skipped until its Task was read).

Saying what it waits for. While it waits for a batch, every few seconds it takes a `view` of the window: the head (the
oldest unfinished group, which bounds what the window may hand out), how long it has waited, what it misses (its
sample; of its sessions, how many opened and finished on forge.sessions) and when the backstop above skips it. Once the
head has waited `report.WAIT_SAY_S` it logs that in one line (again every `SAY_EVERY_S`, and whenever the head
changes), and with `view_path` set it writes the view there for `forge-stream status` (forge_stream.scheduler.report).

Window basis. `SchedulerSettings.window` is a WindowSpec. A fraction applies to `rollout_slots` (the
rollout concurrency, as in the benchmark) when it is set, otherwise to the current queue (groups submitted
and not yet consumed).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Literal, Protocol

from forge_stream.events import deterministic_id, encode, now_ms
from forge_stream.events.claims import ClaimError, redeem
from forge_stream.kafka.consumer import DecodingConsumer, Event, commit_end_offsets, dead_letter
from forge_stream.kafka.history import Slice, read_slice
from forge_stream.kafka.producer import EventProducer
from forge_stream.kafka.reader import PartitionReader
from forge_stream.processors.groups import InvalidEvent, validate as check_event
from forge_stream.scheduler import report
from forge_stream.scheduler.window import WindowedFifo, WindowSpec
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)
ACTIVITY_TOPICS = (TOPICS.sessions, TOPICS.completions, TOPICS.tool_spans, TOPICS.rewards)
VIEW_EVERY_S = 5.0  # how often a consumer waiting for a batch takes (and writes) its view
SAY_EVERY_S = 60.0  # how often it logs again that the same head still waits

@dataclass(frozen=True)
class SchedulerSettings:
    """One scheduler process: which run it feeds and how it shapes batches."""

    bootstrap: str
    run: str
    batch_size: int = 32
    window: WindowSpec = field(default_factory=WindowSpec)
    rollout_slots: int | None = None
    group_timeout_s: float = 900.0
    max_staleness: int | None = None
    stale_action: Literal["drop", "keep"] = "keep"
    poll_s: float = 0.2
    view_path: Path | None = None  # where to keep the view of what the window waits for (`status` reads it)

    @property
    def name(self) -> str:
        """The consumer group, and the `rejected_by` of this scheduler's dead letters."""
        return f"scheduler:{self.run}"


@dataclass(frozen=True)
class Batch:
    """Groups handed to the trainer, with the staleness of each (trainer version minus sample version)."""

    samples: list[dict]
    staleness: list[int]
    policy_version: int
    over_bound: int

    @property
    def group_ids(self) -> list[str]:
        return [s["group_id"] for s in self.samples]

    @property
    def staleness_mean(self) -> float:
        return sum(self.staleness) / len(self.staleness)

    @property
    def staleness_max(self) -> int:
        return max(self.staleness)


class Trainer(Protocol):
    """What the loop drives: the current policy version and one optimizer step per batch."""

    policy_version: int

    def train(self, batch: Batch) -> dict:
        """Train on the batch; return the TrainStep metric fields it knows (loss, mean_reward, ...)."""


def start_at_end(settings: SchedulerSettings) -> None:
    """Begin a new run at the current end of forge.tasks and forge.samples (what came before is not its queue).

    Commits the end offsets for the scheduler's consumer group, which has no offsets yet.
    """
    commit_end_offsets(settings.bootstrap, settings.name, [TOPICS.tasks, TOPICS.samples])


@dataclass(frozen=True)
class Recovered:
    """What earlier runs of this scheduler made durable."""

    retired: frozenset[str]
    steps: int
    last_version: int | None


def recover(settings: SchedulerSettings) -> Recovered:
    """Groups already trained (TrainStep.group_ids of this run) or rejected by this scheduler (forge.dlq)."""
    retired: set[str] = set()
    steps, version = 0, None
    for event in read_slice(settings.bootstrap, TOPICS.train_metrics, Slice()):
        key, record = event.key, event.record
        if key == settings.run:
            retired.update(record["group_ids"])
            steps = max(steps, record["step"] + 1)
            version = record["policy_version"] if version is None else max(version, record["policy_version"])
    for event in read_slice(settings.bootstrap, TOPICS.dlq, Slice()):
        if event.record["rejected_by"] == settings.name and event.key is not None:
            retired.add(event.key)
    return Recovered(frozenset(retired), steps, version)


class WindowedConsumer:
    """Feeds a trainer from Kafka in bounded FIFO order; see the module docstring for the guarantees."""

    def __init__(self, settings: SchedulerSettings, producer: EventProducer | None = None,
                 recovered: Recovered | None = None, validate: Callable[[dict], None] | None = None):
        """`validate(sample)` raises ValueError for a TrainSample the trainer cannot use; such a sample goes to
        forge.dlq and its group is skipped, instead of failing a training step."""
        self.settings = settings
        self._validate = validate
        recovered = recovered or recover(settings)
        self.retired: set[str] = set(recovered.retired)
        self.step = recovered.steps
        self.skipped: list[str] = []
        self.dropped: list[str] = []
        self._core = WindowedFifo(None)
        self._producer = producer or EventProducer(settings.bootstrap)
        self._source = DecodingConsumer(settings.bootstrap, settings.name, [TOPICS.tasks, TOPICS.samples],
                                        name=settings.name, producer=self._producer)
        self._marks = self._source.marks  # a record is held there until its group retires
        self._tasks: dict[int, Event] = {}
        self._seq_of: dict[str, int] = {}
        self._samples: dict[int, Event] = {}
        self._records_of: dict[str, list[tuple[str, int, int]]] = {}
        self._active_ms: dict[str, int] = {}  # a queued group's latest event time known here
        self._reader = PartitionReader(settings.bootstrap)
        self._viewed_ms = 0  # when the last view was taken
        self._said: tuple[str | None, int] = (None, 0)  # the head last logged as waiting, and when

    def poll(self, timeout: float) -> bool:
        """Ingest at most one event; False when nothing arrived."""
        event = self._source.poll(timeout)
        if event is None:
            return False
        group = event.record["group_id"]
        if group in self.retired:
            return True
        self._marks.hold(event.topic, event.partition, event.offset)
        self._records_of.setdefault(group, []).append((event.topic, event.partition, event.offset))
        if event.schema == "Task":
            self._queue(event)
        elif event.schema == "GroupSkipped":
            self._reject(event, f"group skipped by the processors: {event.record['reason']}")
            self.skipped.append(group)
        else:
            self._finish(event)
        return True

    def next_batch(self, trainer_version: int, wait_s: float, partial: bool = False) -> Batch | None:
        """A full batch as soon as the window offers one; after `wait_s` None, or what there is if `partial`."""
        deadline = now_ms() + wait_s * 1000
        while True:
            self._expire()
            self._core.window = self._window()
            self._say()
            if self._source.caught_up and self._core.available() >= self.settings.batch_size:
                batch = self._take(trainer_version, self.settings.batch_size)
                if batch is not None:
                    return batch
                continue
            if now_ms() >= deadline:
                return self._take(trainer_version, self.settings.batch_size) if partial and self._source.caught_up \
                    else None
            if self.poll(self.settings.poll_s):
                while self.poll(0):
                    pass

    def ack(self, batch: Batch, metrics: dict) -> dict:
        """Publish the step's TrainStep (the durable record of what was trained), then commit offsets."""
        record = step_record(self.settings.run, self.step, batch, metrics)
        self._producer.send_sync(TOPICS.train_metrics, self.settings.run, record)
        self.step += 1
        for group in batch.group_ids:
            self._retire(group)
        self.commit()
        return record

    def run(self, trainer: Trainer, steps: int, wait_s: float = 30.0) -> list[dict]:
        """Train `steps` batches (fewer if no batch comes within `wait_s`); returns the TrainStep records."""
        out = []
        for _ in range(steps):
            batch = self.next_batch(trainer.policy_version, wait_s)
            if batch is None:
                break
            out.append(self.ack(batch, trainer.train(batch)))
        return out

    def commit(self) -> None:
        """Commit each partition up to (not including) its first record whose group is not retired."""
        self._source.commit()

    def view(self) -> dict:
        """What the window waits for (forge_stream.scheduler.report), now: its head's sessions are looked up on
        forge.sessions once it has waited `report.WAIT_SAY_S`."""
        now = now_ms()
        view = {"run": self.settings.run, "pid": os.getpid(), "updated_ms": now, "step": self.step,
                "window": self._core.window, "queued": self._core.pending(), "held": len(self._samples), "head": None}
        seq = self._core.frontier
        if seq is None or seq not in self._tasks or not self._source.caught_up:
            return view
        task = self._tasks[seq].record
        since = max(task["event_time"], self._tasks[seq].timestamp_ms)
        waited_s = max(0.0, (now - since) / 1000)
        sessions = group_sessions(self._reader, task["group_id"], since) if waited_s >= report.WAIT_SAY_S else None
        view["head"] = {"group_id": task["group_id"], "task_id": task["task_id"], "seq": seq, "waited_s": waited_s,
                        "group_size": task["group_size"], "sessions": sessions,
                        "skip_at_ms": int(self._active_ms[task["group_id"]] + self.settings.group_timeout_s * 1000)}
        return view

    def _say(self) -> None:
        """Every VIEW_EVERY_S: take the view, write it to `view_path`, and log a head that has waited long (once per
        head, then every SAY_EVERY_S)."""
        now = now_ms()
        if now - self._viewed_ms < VIEW_EVERY_S * 1000:
            return
        self._viewed_ms = now
        view = self.view()
        head = view["head"]
        if head is not None and head["waited_s"] >= report.WAIT_SAY_S:
            said, at = self._said
            if said != head["group_id"] or now - at >= SAY_EVERY_S * 1000:
                log.info("waiting for a batch: %s", report.line(view, now))
                self._said = (head["group_id"], now)
        if self.settings.view_path is not None:
            report.write_view(self.settings.view_path, view)

    def close(self) -> None:
        if self.settings.view_path is not None:
            self.settings.view_path.unlink(missing_ok=True)
        self._source.close()
        self._reader.close()
        self._producer.close()

    def _queue(self, task: Event) -> None:
        """A Task joins the queue, unless the processors would reject it (then it is dead-lettered and skipped)."""
        try:
            check_event("Task", task.record)
        except InvalidEvent as exc:
            self._reject(task, f"invalid Task: {exc}")
            self.skipped.append(task.record["group_id"])
            return
        group, seq = task.record["group_id"], task.record["seq"]
        if group in self._seq_of:  # a group is queued once, at the seq it was first read with
            return
        self._tasks.setdefault(seq, task)
        self._seq_of[group] = seq
        self._active_ms[group] = max(task.record["event_time"], task.timestamp_ms)
        self._core.submit(seq)

    def _finish(self, sample: Event) -> None:
        try:
            if self._validate is not None and sample.schema == "TrainSample":  # a claim is checked when redeemed
                self._validate(sample.record)
        except ValueError as exc:
            self._reject(sample, f"invalid TrainSample: {exc}")
            return
        seq = sample.record["task_seq"]
        self._samples.setdefault(seq, sample)
        self._core.finish(seq)

    def _redeem(self, claim: Event) -> Event | None:
        """The TrainSample a SampleClaim stands for, fetched when the window hands its group over (held claims
        are small); None when it cannot be had or used (dead-lettered, the group skipped)."""
        try:
            sample = redeem(claim.record)
            if self._validate is not None:
                self._validate(sample)
        except ClaimError as exc:
            self._reject(claim, f"claimed TrainSample unavailable: {exc}")
        except ValueError as exc:
            self._reject(claim, f"invalid TrainSample: {exc}")
        else:
            return replace(claim, schema="TrainSample", record=sample)
        self.skipped.append(claim.record["group_id"])
        return None

    def _window(self) -> int | None:
        basis = self.settings.rollout_slots or max(1, self._core.pending())
        return self.settings.window.resolve(basis)

    def _take(self, version: int, n: int) -> Batch | None:
        samples, staleness, over = [], [], 0
        bound, drop = self.settings.max_staleness, self.settings.stale_action == "drop"
        while len(samples) < n:
            seqs = self._core.take(n - len(samples))
            if not seqs:
                break
            for seq in seqs:
                event = self._samples.pop(seq)
                self._tasks.pop(seq, None)
                if event.schema == "SampleClaim" and (event := self._redeem(event)) is None:
                    continue
                lag = version - event.record["policy_version"]
                if bound is not None and lag > bound:
                    if drop:
                        self._reject(event, f"staleness {lag} > bound {bound}: dropped")
                        self.dropped.append(event.record["group_id"])
                        continue
                    over += 1
                samples.append(event.record)
                staleness.append(lag)
        if not samples:
            self.commit()
            return None
        return Batch(samples, staleness, version, over)

    def _expire(self) -> None:
        """Skip the group that blocks the window once it has had no event for longer than the timeout.

        The clock starts at the Task (its event time, or when it was written to Kafka if that is later: a back-filled
        Task stream is not skipped wholesale). When it runs out, the group's later events are looked up on Kafka
        (`group_activity`) and the clock goes on from the latest. Everything it counts from is on Kafka, so a
        restarted trainer goes on with the clock instead of starting it again. Nothing expires before the consumer
        has caught up with its inputs (a poll found nothing), so a restart does not skip a group whose sample waits
        unread.
        """
        if not self._source.caught_up:
            return
        timeout_ms = self.settings.group_timeout_s * 1000
        while (seq := self._core.frontier) is not None and seq in self._tasks:
            task = self._tasks[seq]
            group = task.record["group_id"]
            if now_ms() - self._active_ms[group] < timeout_ms:
                return
            self._active_ms[group] = group_activity(self._reader, group, self._active_ms[group])
            if now_ms() - self._active_ms[group] < timeout_ms:
                return
            self._reject(task, f"no event of the group for {self.settings.group_timeout_s:g}s and the processors "
                               f"did not close it: skipped by the windowed FIFO; its partial rollouts, if any, "
                               f"stay on {TOPICS.trajectories.name}")
            self.skipped.append(group)

    def _reject(self, event: Event, error: str) -> None:
        """Record the event on forge.dlq (the durable record of the skip) and retire its group."""
        group = event.record["group_id"]
        record = dead_letter(event.topic, event.partition, event.offset, group.encode(),
                             encode(event.schema, event.record), error, self.settings.name)
        self._producer.send_sync(TOPICS.dlq, group, record)
        self._retire(group)

    def _retire(self, group: str) -> None:
        """The group is done with (trained or skipped): out of the queue, and its records no longer hold commits."""
        self.retired.add(group)
        seq = self._seq_of.pop(group, None)
        if seq is not None:
            self._core.skip(seq)
            self._tasks.pop(seq, None)
            self._samples.pop(seq, None)
        self._active_ms.pop(group, None)
        for topic, partition, offset in self._records_of.pop(group, []):
            self._marks.release(topic, partition, offset)


def group_activity(reader: PartitionReader, group: str, since_ms: int) -> int:
    """The latest event time of `group` on the processors' inputs other than forge.tasks (sessions, completions,
    tool spans, rewards), looked up from `since_ms` on (its partition of each topic, records written since then);
    `since_ms` when there is none. An event's time is its event time, or when it was written to Kafka if later."""
    latest = since_ms
    for topic in ACTIVITY_TOPICS:
        partition = reader.partition_of(topic, group)
        start, end = reader.offset_at(topic, partition, since_ms), reader.high(topic, partition)
        for _, written_ms, _, record in reader.read(topic, partition, start, end, key=group):
            latest = max(latest, written_ms, record["event_time"])
    return latest


def group_sessions(reader: PartitionReader, group: str, since_ms: int) -> dict[str, int]:
    """How many sessions of `group` started and finished on forge.sessions (its partition, from `since_ms` on)."""
    partition = reader.partition_of(TOPICS.sessions, group)
    start, end = reader.offset_at(TOPICS.sessions, partition, since_ms), reader.high(TOPICS.sessions, partition)
    events = reader.read(TOPICS.sessions, partition, start, end, key=group)
    started = {record["session_id"] for _, _, schema, record in events if schema == "SessionStarted"}
    finished = {record["session_id"] for _, _, schema, record in events if schema == "SessionFinished"}
    return {"started": len(started | finished), "finished": len(finished)}


def step_record(run: str, step: int, batch: Batch, metrics: dict) -> dict:
    """The TrainStep of one step: the trainer's metrics plus what the scheduler knows about the batch."""
    total = sum(s["total_tokens"] for s in batch.samples)
    unique = sum(s["unique_tokens"] for s in batch.samples)
    base = {
        "event_id": deterministic_id("train_step", run, step), "event_time": now_ms(), "step": step,
        "policy_version": batch.policy_version, "loss": 0.0, "mean_reward": 0.0,
        "groups": len(batch.samples), "sequences": sum(len(s["sequences"]) for s in batch.samples),
        "total_tokens": total, "unique_tokens": unique, "tree_ratio": total / unique if unique else 1.0,
        "tokens_per_s": 0.0, "staleness_mean": batch.staleness_mean, "staleness_max": batch.staleness_max,
        "grad_norm": 0.0, "lr": 0.0, "loss_name": "", "outcome_reward": 0.0, "rollouts": 0,
        "mismatch_mean": 0.0, "mismatch_max": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "clip_fraction": 0.0,
        "per_update": [], "groups_without_signal": 0,
    }
    return base | metrics | {"group_ids": batch.group_ids}
