"""The processors topology: faust-streaming agents that run `forge_stream.processors` against Kafka.

Inputs (all keyed by group_id, 4 partitions, so a group's events meet in one partition):
forge.tasks, forge.sessions, forge.completions, forge.tool_spans, forge.rewards.
Outputs: forge.trajectories, forge.samples, forge.rewards (the reward components), forge.dlq.

- settings: one ProcessorSettings (reward rules, gamma, advantage mode "rollout" or "turn", timeouts), built by
  `forge-stream processors run` (--gamma, --advantage, --group-timeout-s, --group-max-completions,
  --group-max-tokens) and passed in TopologyConfig.
- agent `groups`: decodes each record (raw bytes, our Avro codec), folds it into the group's state and
  publishes what the fold returns. The state lives in the `groups` table (memory store, rebuilt from its
  compacted changelog topic on restart) in pieces: a header per group plus one entry per record it holds
  (forge_stream.processors.store.GroupStore), so an event writes its own record, never the whole group.
  Undecodable or invalid records become DeadLetters on forge.dlq; processing goes on.
- timer `timeouts`: every `tick_s` scans the table for groups whose deadline passed (last event time plus
  the timeout, against wall time: an idle group) and asks agent `timeouts` to close them through the app's internal
  `<app_id>-timeouts` topic, on the group's own partition. Faust only lets a stream modify a table, and this
  keeps every table write on the group's partition. A group is closed (and a closed marker forgotten) only once
  the worker has folded everything its partitions held when it fell due, as the read-marks sweep saw their ends
  (forge_stream.processors.progress): a worker behind on its inputs reads its backlog first, instead of closing
  groups whose records are in Kafka but not read yet.
- A TrainSample whose encoding exceeds `claim_over_bytes` is stored in the claim-check store and published as
  a SampleClaim (forge_stream.events.claims): forge.samples records stay small whatever the group's size.
- Outputs go to the group's input partition (the producer's partitioner chose it), so the output topics stay
  co-partitioned with the inputs whatever client produced them.

Read marks: with each input record folded, the table records its offset as the partition's read mark (one small
value per input partition, written after the record's state, restored with it). A record at or below the mark is
in the table already and is passed over; one above mark + 1 means the consumer skipped records, which faust 0.15
can do when a rebalance hands a partition over (a prefetched record dropped, and acknowledged, as stale): the agent
reads the skipped offsets straight from Kafka and folds them first. A skipped record that no later record follows
yet is found by the `read-marks-sweep` timer: the group's committed offset passed it, the mark did not; so is a
partition faust stopped delivering after a restart (records wait past its mark, which stood still for a whole sweep:
seen in the SIGKILL test). So what the table holds never depends on faust's
offset bookkeeping: every input record is folded once, in partition order, whatever the rebalances.

Delivery: at-least-once. Agents run at concurrency 1 and share one lock, so a group is never folded by both
at once. A group's outputs are acknowledged by Kafka *before* its closed marker is written to the table, so
a crash either left the group open (a replay closes it again and re-emits identical records: same ids,
same content) or already published everything. Consumers downstream deduplicate on event_id. Offsets are
committed only once every table write before them was handed to the Kafka client and acknowledged
(`_DrainingBuffer` fixes faust's producer-buffer flush, which could return with writes still queued). The
producer is idempotent with acks=all (`_IdempotentProducer`), like every producer of forge-stream, and the topics
faust creates are replicated as the deployment's catalog (`TopologyConfig.replication`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import KafkaException
import faust
from faust.transport.drivers.aiokafka import Producer as AiokafkaProducer

from forge_stream.events import DecodeError, decode, encode, now_ms
from forge_stream.events.claims import CLAIM_OVER_BYTES, ClaimStore, claim_record
from forge_stream.kafka.consumer import dead_letter, partition_positions
from forge_stream.kafka.reader import read_range
from forge_stream.processors import Emit, InvalidEvent, ProcessorSettings, expire, fold
from forge_stream.processors.groups import due, due_ms
from forge_stream.processors.progress import EndsSeen
from forge_stream.processors.store import GroupStore, MissingEntry, is_group, mark_key
from forge_stream.topics import EMBEDDED, TOPICS, ROLLOUT_PARTITIONS, Replication

INPUTS = (TOPICS.tasks, TOPICS.sessions, TOPICS.completions, TOPICS.tool_spans, TOPICS.rewards)
OUTPUTS = (TOPICS.trajectories, TOPICS.samples, TOPICS.rewards, TOPICS.dlq)
log = logging.getLogger(__name__)
RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}


@dataclass(frozen=True)
class TopologyConfig:
    bootstrap: str
    data_dir: Path
    app_id: str = "forge-processors"  # names the consumer group, the table's changelog and internal topics
    processors: ProcessorSettings = field(default_factory=ProcessorSettings)
    tick_s: float = 1.0
    offset_reset: str = "earliest"  # where a new consumer group starts: earliest or latest
    commit_interval_s: float = 0.5
    replication: Replication = EMBEDDED  # the deployment's: of the changelog and internal topics faust creates too
    claim_store: str | None = None  # fsspec URL of the claim-check store (None: data_dir/claims)
    claim_over_bytes: int = CLAIM_OVER_BYTES  # a TrainSample encoded larger than this goes as a SampleClaim
    sweep_s: float = 10.0  # how often the read marks are compared with committed offsets and ends (see `sweep`)


def build_app(config: TopologyConfig) -> faust.App:
    _DrainingBuffer.install()
    app = faust.App(
        config.app_id, broker=f"kafka://{config.bootstrap}", store="memory://", datadir=str(config.data_dir),
        topic_partitions=ROLLOUT_PARTITIONS, topic_replication_factor=config.replication.factor,
        table_standby_replicas=0,
        web_enabled=False, stream_wait_empty=False, consumer_auto_offset_reset=config.offset_reset,
        broker_session_timeout=10.0, broker_heartbeat_interval=1.0, broker_commit_interval=config.commit_interval_s,
        producer_acks=-1, producer_max_request_size=TOPICS.largest_message_bytes(),
    )
    app.transport.Producer = _IdempotentProducer
    settings = config.processors
    in_sync = {"min.insync.replicas": str(config.replication.min_insync)}  # the topics faust creates, as the catalog's
    inputs = app.topic(*(t.name for t in INPUTS), **RAW)
    timeouts = app.topic(f"{config.app_id}-timeouts", partitions=ROLLOUT_PARTITIONS, internal=True, config=in_sync,
                         **RAW)
    outputs = {t.name: app.topic(t.name, **RAW) for t in OUTPUTS}
    groups = app.Table("groups", partitions=ROLLOUT_PARTITIONS, key_type=str, extra_topic_configs=in_sync)
    store = GroupStore(groups, groups)  # a header per group plus an entry per record, one changelog
    lock = asyncio.Lock()

    claims = ClaimStore(config.claim_store or str(Path(config.data_dir).resolve() / "claims"))

    async def wire(emit: Emit) -> bytes:
        """The record's bytes; a TrainSample over `claim_over_bytes` is stored and sent as its SampleClaim."""
        value = encode(emit.schema, emit.record)
        if emit.schema == "TrainSample" and len(value) > config.claim_over_bytes:
            claim = await asyncio.to_thread(claims.put, value)
            value = encode("SampleClaim", claim_record(emit.record, claim))
        return value

    async def publish(emits: list[Emit], partition: int) -> None:
        sent = [await outputs[e.topic.name].send(key=e.key.encode(), value=await wire(e), partition=partition,
                                                 force=True) for e in emits]
        await asyncio.gather(*sent)  # acknowledged by Kafka before the state that follows them is written

    async def reject(message, error: str, rejected_by: str) -> None:
        record = dead_letter(message.topic, message.partition, message.offset, message.key, message.value,
                             error, rejected_by)
        await publish([Emit(TOPICS.dlq, message.topic, "DeadLetter", record)], None)

    async def fold_record(message) -> None:
        """Fold one input record into its group and publish what that closes (call it holding the lock)."""
        try:
            schema, record = decode(message.value or b"")
            if schema not in TOPICS.by_name(message.topic).value_schemas:
                raise DecodeError(f"{message.topic} does not carry {schema}")
            held, snapshot = store.load(record.get("group_id", ""))
            state, emits = fold(held, schema, record, settings, message.partition)
            await publish(emits, message.partition)
            if state is not None:
                store.save(record["group_id"], state, snapshot)
        except (DecodeError, InvalidEvent) as exc:
            await reject(message, str(exc), "processors.groups")
        except MissingEntry as exc:  # never expected: say so loudly, and keep the event (forge.dlq)
            log.error("%s", exc)
            await reject(message, str(exc), "processors.groups")

    async def catch_up(topic: str, partition: int, stop: int, why: str = "skipped") -> None:
        """Fold the records between topic[partition]'s read mark and `stop` (exclusive), read straight from Kafka:
        records the consumer skipped, or has not delivered (call it holding the lock)."""
        mark = mark_key(topic, partition)
        last = groups.get(mark)
        if last is None or last + 1 >= stop:
            return
        missed = await asyncio.to_thread(read_range, config.bootstrap, topic, partition, last + 1, stop)
        log.warning("%s[%d]: the consumer %s offsets %d to %d (faust 0.15 around a rebalance or restart); folding "
                    "the %d records there, read from Kafka", topic, partition, why, last + 1, stop - 1, len(missed))
        for record in missed:
            await fold_record(record)
        groups[mark] = stop - 1

    redelivered: set[tuple[str, int]] = set()  # partitions in a logged run of redelivered records

    @app.agent(inputs, name="groups", concurrency=1)
    async def fold_groups(stream):
        try:
            await _fold_groups(stream)
        except Exception:  # faust restarts a crashed agent without a word: say what crashed it
            log.exception("the groups agent crashed; faust restarts it")
            raise

    async def _fold_groups(stream):
        async for event in stream.events():
            message = event.message
            tp = (message.topic, message.partition)
            async with lock:
                mark = mark_key(*tp)
                last = groups.get(mark)
                if last is not None and message.offset <= last:  # in the table already: a redelivery
                    if tp not in redelivered:
                        redelivered.add(tp)
                        log.info("%s[%d]: offsets up to %d are folded already (the table says so); passing over "
                                 "their redelivery", *tp, last)
                    continue
                await catch_up(*tp, message.offset)
                await fold_record(message)
                groups[mark] = message.offset
                redelivered.discard(tp)

    @app.agent(timeouts, name="timeouts", concurrency=1)
    async def close_expired(stream):
        async for value in stream:
            request = json.loads(value)
            if "sweep" in request:  # from `sweep` below: records skipped at a partition's end
                async with lock:
                    await catch_up(request["sweep"], request["partition"], request["stop"],
                                   "skipped or did not deliver")
                continue
            group_id = request["group_id"]
            async with lock:
                try:
                    state, snapshot = store.load(group_id)
                except MissingEntry as exc:
                    log.error("cannot close it: %s", exc)
                    continue
                new, emits = expire(state, now_ms(), settings)
                if state is not None and new is not state:
                    await publish(emits, state["partition"])
                    store.save(group_id, new, snapshot)

    ends_seen = EndsSeen()  # the input partitions' ends as the sweep saw them (forge_stream.processors.progress)
    unread_from: dict[tuple[str, int], int | None] = {}  # where folding starts on a partition nothing was folded from

    def folded_to(topic: str, partition: int) -> int | None:
        """The next offset of topic[partition] this worker folds (None before the sweep first looked at it)."""
        last = groups.get(mark_key(topic, partition))
        return last + 1 if last is not None else unread_from.get((topic, partition))

    quiet_until = 0  # when the next "waiting for the backlog" line may be logged

    @app.timer(config.tick_s, name="timeouts-scan")
    async def scan() -> None:
        """Ask the timeouts agent to close each group past its deadline (and to forget each closed marker past its
        time), once this worker folded everything the group's partitions held then: a worker behind on its inputs
        reads before it closes (forge_stream.processors.progress)."""
        nonlocal quiet_until
        now = now_ms()
        waiting: dict[int, int] = {}
        for group_id, state in list(groups.items()):
            if not is_group(group_id) or not due(state, now, settings):
                continue
            partition = state["partition"]
            due_at = due_ms(state, settings)
            if not ends_seen.read_past([(t.name, partition) for t in INPUTS], due_at, folded_to):
                if now - due_at > 2 * config.sweep_s * 1000:  # not only waiting for the next sweep: behind
                    waiting[partition] = waiting.get(partition, 0) + 1
                continue
            await timeouts.send(key=group_id.encode(), value=json.dumps({"group_id": group_id}).encode(),
                                partition=partition)
        if waiting and now >= quiet_until:
            quiet_until = now + 30_000
            log.info("%d groups (or closed markers) are due on input partitions %s, which this worker has not read "
                     "up to their due time yet: they are closed once it has (it reads its backlog first)",
                     sum(waiting.values()), sorted(waiting))

    inputs_names = {t.name for t in INPUTS}

    marks_seen: dict[tuple[str, int], int | None] = {}  # each partition's read mark at the last sweep

    @app.timer(config.sweep_s, name="read-marks-sweep")
    async def sweep() -> None:
        """What the groups agent cannot see: a skipped record that no later record follows yet (the group's
        committed offset passed it, its read mark did not), and a partition faust stopped delivering (records wait
        past the mark, and the mark stood still for a whole sweep: faust 0.15 can leave a partition paused after a
        restart). Sent to the timeouts agent on that partition, which folds them from Kafka (table writes need a
        stream); faust's late deliveries of them, if any, are then redeliveries."""
        try:
            assigned = app.consumer.assignment()
        except Exception as exc:  # not started or between assignments: the next tick sees the new one
            log.debug("read-marks sweep passed over: %r", exc)
            return
        mine = [(tp.topic, tp.partition) for tp in assigned if tp.topic in inputs_names]
        if not mine:
            return
        asked_at = now_ms()  # before asking: each end seen held at least what the partition had then
        try:
            positions = await asyncio.to_thread(partition_positions, config.bootstrap, config.app_id, mine)
        except KafkaException as exc:  # a broker restarting or a coordinator moving: transient, not a crash
            log.warning("read-marks sweep passed over, Kafka did not answer (%s); the next sweep asks again", exc)
            return
        for (topic, partition), (committed, end, low) in positions.items():
            ends_seen.saw(topic, partition, asked_at, end)
            unread_from[(topic, partition)] = (committed if committed is not None  # else a new group's start:
                                               else low if config.offset_reset == "earliest"
                                               else ends_seen.first(topic, partition))
            last = groups.get(mark_key(topic, partition))
            before, marks_seen[(topic, partition)] = marks_seen.get((topic, partition), -2), last
            if last is None:  # nothing folded from it yet: no mark to go by
                continue
            if committed is not None and committed - 1 > last:
                stop = committed
            elif end - 1 > last and before == last:
                stop = end
            else:
                continue
            await timeouts.send(key=f"{topic}:{partition}".encode(), partition=partition, value=json.dumps(
                {"sweep": topic, "partition": partition, "stop": stop}).encode())

    return app


class _IdempotentProducer(AiokafkaProducer):
    """faust's aiokafka producer with idempotence on, as every producer of forge-stream (faust turns it on only
    inside its own transactions, which the processors do not use): a send that aiokafka retries after a broker
    failover is written once, and in order, instead of twice. Its partitioner stays aiokafka's default, murmur2 as
    Kafka's Java client (forge_stream.kafka.partitioner); the processors pass the partition of every output but
    dead letters."""

    def _settings_extra(self):
        return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}


class _DrainingBuffer:
    """A fix for faust-streaming 0.15's ProducerBuffer.flush, which returns as soon as no message was sent for
    0.1 s, with messages still queued. The consumer commits offsets right after that flush
    (Consumer._commit_offsets: producer.flush(), then commit), and table changelog writes wait in that buffer
    (Table.__setitem__ -> send_soon). So on a loaded machine a commit can pass events whose state has not
    reached the changelog yet, and a SIGKILL then loses that state for good. Installed by `install()`: flush
    waits until the buffer is empty and the message being handed to the Kafka client has been handed over
    (the client's own flush, which faust runs next, then waits for its acknowledgement)."""

    installed = False

    @classmethod
    def install(cls) -> None:
        from faust.transport.producer import ProducerBuffer

        if cls.installed:
            return
        send_pending = ProducerBuffer._send_pending

        async def counted_send(self, fut) -> None:
            self._forge_in_flight = getattr(self, "_forge_in_flight", 0) + 1
            try:
                await send_pending(self, fut)
            finally:
                self._forge_in_flight -= 1

        async def flush(self) -> None:
            while self.size or getattr(self, "_forge_in_flight", 0):
                if self.state != "running" and self.size:
                    raise RuntimeError("cannot flush: the producer buffer stopped with messages queued")
                await asyncio.sleep(0.005)

        ProducerBuffer._send_pending = counted_send
        ProducerBuffer.flush = flush
        cls.installed = True


class _RetriedCoordinatorLookups(logging.Filter):
    """aiokafka logs a retried group-coordinator lookup at ERROR ("Group Coordinator Request failed:
    GroupCoordinatorNotAvailableError"), which is what every start against a fresh broker sees while the broker
    loads its coordinator; it then retries. Such a record is a WARNING that says so; other errors stay errors."""

    RETRIED = ("CoordinatorNotAvailable", "CoordinatorLoadInProgress", "NotCoordinator")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and any(name in record.getMessage() for name in self.RETRIED):
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = f"{record.getMessage()} (the broker is still electing or loading the " \
                                      "group coordinator; retrying)", ()
        return True


class _LoadNotices(logging.Filter):
    """faust logs two things at WARNING that a loaded machine sees all the time and that need nothing done: its
    producer buffer holding over 100 table writes ("producer buffer full size N": the stream waits for them to reach
    Kafka, which is its backpressure) and a timer whose run took longer than its interval ("Timer commit is
    overlapping": a commit waited for the cores). They become INFO records that say so; a timer that ran for over
    `stalled_s` stays a WARNING (a commit that slow is a broker or a worker in trouble)."""

    stalled_s = 30.0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        message = record.getMessage()
        if message.startswith("producer buffer full size"):
            note = "the stream waits for its table writes to reach Kafka: backpressure, normal under load"
        elif str(record.msg).startswith("Timer %s is overlapping") and len(record.args or ()) == 3:
            runtime = record.args[2]
            if not isinstance(runtime, (int, float)) or runtime > self.stalled_s:
                return True
            note = "it waited for a busy machine; normal under load"
        else:
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = f"{message} ({note})", ()
        return True


def install_log_filters() -> None:
    """What a newcomer reads in the processors' log: retried coordinator lookups and load notices are not
    errors."""
    for name in ("aiokafka.consumer.group_coordinator", "aiokafka.producer.sender"):
        logging.getLogger(name).addFilter(_RetriedCoordinatorLookups())
    for name in ("faust.transport.producer", "mode.timers"):
        logging.getLogger(name).addFilter(_LoadNotices())


def run_worker(config: TopologyConfig, loglevel: str = "info") -> None:
    """Run the topology in this process until it is stopped (SIGTERM/SIGINT)."""
    install_log_filters()
    app = build_app(config)
    faust.Worker(app, loglevel=loglevel, quiet=True).execute_from_commandline()
