"""The fault suite, modelled on Kafka's own delivery checks: the local topology (its own broker on free ports, the
tiny model in the engine and the trainer) under scripted agent traffic, while the gateway, the processors, the
trainer, the engine and the broker are each SIGKILLed and restarted in turn, and poison is injected on every input
topic. Then every topic is drained and checked against the agents' ledger:

- every acknowledged completion, span, reward and finish is recorded; no event id twice on a source topic, and a
  processor output re-emitted after a restart is the identical record;
- every finished group yields one TrainSample and is trained exactly once; no poison group is trained and every
  poison record is dead-lettered;
- the processors' rewards, trajectories (reward, reward-to-go, advantage) and samples equal a batch recomputation
  from the source topics.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from confluent_kafka import Consumer

from forge_stream import credentials
from forge_stream.deploy import local_broker
from forge_stream.kafka.broker import free_port
from forge_stream.processors import ProcessorSettings
from forge_stream.processors.rewards import advantages, reward_to_go
from forge_stream.services import Supervisor
from forge_stream.settings import ForgeSettings
from forge_stream.topics import TOPICS

from fault_checks import SOURCES, bounds, drain, events, inject_poison, recompute
from fault_agents import Traffic
from helpers import until

REPO = Path(__file__).resolve().parents[2]
REQUEST_ID = re.compile(r"(req-\d+): ")
VICTIMS = ("gateway", "processors", "trainer", "engine", "broker")

# about 4 minutes on 2 idle cores; more when loaded
pytestmark = [pytest.mark.slow, pytest.mark.kafka, pytest.mark.timeout(900)]


def dead_letters(bootstrap: str) -> dict[tuple[str, int, int], set[str]]:
    """Who rejected each record that was dead-lettered, by where it sits (topic, partition, offset)."""
    out: dict[tuple[str, int, int], set[str]] = {}
    for e in events(drain(bootstrap, TOPICS.dlq)):
        out.setdefault((e["topic"], e["partition"], e["offset"]), set()).add(e["rejected_by"])
    return out


class Deployment:
    """`forge-stream up` of the fault topology on a fresh home, and what the test needs to hurt it."""

    def __init__(self, tmp_path: Path, model: Path):
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
        self.env["FORGE_HOME"] = str(tmp_path / "home")
        for name in ("KAFKA_PORT", "KAFKA_CONTROLLER_PORT", "REGISTRY_PORT", "ENGINE_PORT", "GATEWAY_PORT"):
            self.env[f"FORGE_{name}"] = str(free_port())
        self.settings = ForgeSettings(home=tmp_path / "home", bootstrap_servers=None,
                                      kafka_port=int(self.env["FORGE_KAFKA_PORT"]),
                                      kafka_controller_port=int(self.env["FORGE_KAFKA_CONTROLLER_PORT"]))
        self.bootstrap = self.settings.bootstrap
        self.gateway = f"http://127.0.0.1:{self.env['FORGE_GATEWAY_PORT']}"
        self.engine = f"http://127.0.0.1:{self.env['FORGE_ENGINE_PORT']}"
        self.supervisor = Supervisor(self.settings.run_dir)
        self.topology = tmp_path / "faults.yaml"
        self.topology.write_text(f"""name: faults
services:
  - engine: {{model: {model}, max_batch_size: 8, threads: 1}}
  - gateway
  - processors: {{group_timeout_s: 600}}
  - trainer: {{model: {model}, batch_size: 2, window: 0.5, lr: 1e-4, wait_s: 2, threads: 1}}
""")

    def cli(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "forge_stream", *args], env=self.env, capture_output=True,
                             text=True, timeout=300, cwd=REPO)
        assert out.returncode == 0, out.stderr[-4000:]
        return out.stdout

    def up(self) -> dict:
        return json.loads(self.cli("up", str(self.topology), "--json"))

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "forge_stream", "down"], env=self.env, capture_output=True,
                       timeout=180, cwd=REPO)

    def service(self, name: str) -> dict:
        return self.supervisor.status()[name]

    def kill(self, name: str) -> None:
        """SIGKILL a service (its whole process group) or the embedded broker: the supervisor restarts either."""
        if name == "broker":
            local_broker(self.settings).kill()
        else:
            os.killpg(self.service(name)["pid"], signal.SIGKILL)

    def high(self, topic) -> int:
        """The sum of `topic`'s high watermarks."""
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": "fault-suite-probe", "log_level": 0})
        try:
            return sum(bounds(consumer, topic.name, p)[1] for p in range(topic.partitions))
        finally:
            consumer.close()


def hurt(deployment: Deployment, traffic: Traffic, victim: str, clock) -> None:
    """Kill `victim` while traffic flows, then wait until it is back and doing its work again: new acknowledged
    calls, and for the processors and the broker a new sample, for the trainer and the broker a new step."""
    acked = traffic.ledger.acknowledged
    until(lambda: traffic.ledger.acknowledged >= acked + 6, 60, f"traffic before killing the {victim}")
    if victim == "processors":
        until(lambda: deployment.high(TOPICS.samples) >= 1, 120, "a first sample")
    if victim == "trainer":
        until(lambda: deployment.high(TOPICS.train_metrics) >= 1, 120, "a first training step")
    restarts = deployment.service(victim)["restarts"]
    deployment.kill(victim)
    clock(f"killed the {victim}")
    until(lambda: (s := deployment.service(victim))["restarts"] > restarts and s["healthy"], 120,
          f"the {victim} restarted")
    assert deployment.service(victim)["last_exit"]["reason"] == "killed by SIGKILL"
    if victim == "broker":  # its process runs before it answers: the supervisor has no health URL for it
        local_broker(deployment.settings).wait_ready(120)
    acked, samples, steps = (traffic.ledger.acknowledged, deployment.high(TOPICS.samples),
                             deployment.high(TOPICS.train_metrics))
    until(lambda: traffic.ledger.acknowledged >= acked + 6, 120, f"traffic after the {victim} came back")
    if victim in ("processors", "broker"):
        until(lambda: deployment.high(TOPICS.samples) > samples, 120, f"a sample after the {victim} came back")
    if victim in ("trainer", "broker"):
        until(lambda: deployment.high(TOPICS.train_metrics) > steps, 120, f"a step after the {victim} came back")
    clock(f"the {victim} is back")


def untrained(bootstrap: str, finished: dict[str, int]) -> str:
    """Which finished groups no TrainStep lists, and what forge.samples holds for them (empty when none)."""
    trained = {g for step in events(drain(bootstrap, TOPICS.train_metrics)) for g in step["group_ids"]}
    missing = sorted(set(finished) - trained, key=finished.get)
    if not missing:
        return ""
    held = Counter(e["group_id"] for e in events(drain(bootstrap, TOPICS.samples)))
    return f"{len(missing)} groups not trained: " + ", ".join(f"{g} ({held[g]} samples)" for g in missing[:8])


def test_nothing_acknowledged_is_lost_nor_trained_twice_through_kills_and_poison(tmp_path, tiny_model_dir):
    deployment = Deployment(tmp_path, tiny_model_dir)
    started = time.monotonic()
    timeline = []

    def clock(what: str) -> None:
        timeline.append((what, round(time.monotonic() - started)))
        print(f"{time.monotonic() - started:.0f}s: {what}", flush=True)

    print()
    try:
        deployment.up()
        traffic = Traffic(deployment.gateway, deployment.bootstrap, "faults", group_size=2, concurrency=1,
                          pause_s=0.5,  # leaves CPU to the restarts
                          admin_token=credentials.load(deployment.settings.home).gateway_admin_token)
        traffic.start()
        clock("up")
        for victim in VICTIMS:
            hurt(deployment, traffic, victim, clock)
            if victim == "gateway":  # mid-run: a session in flight gets the NaN reward
                live = until(lambda: next((s for s in traffic.ledger.opened.values()
                                           if s["session_id"] not in traffic.ledger.finished), None), 30,
                             "a session in flight")
                nan_group = live["group_id"]
                landed, poison_groups = inject_poison(deployment.bootstrap, live, "faults")
        traffic.stop()
        traffic.join(240)
        assert not traffic.is_alive() and not traffic.errors, traffic.errors
        finished = dict(traffic.ledger.groups)
        until(lambda: not untrained(deployment.bootstrap, finished), 180,
              lambda: f"every finished group trained: {untrained(deployment.bootstrap, finished)}")
        letters = until(lambda: (d := dead_letters(deployment.bootstrap)) and set(landed) <= set(d) and d, 120,
                        "every poison record dead-lettered")
        clock("every finished group trained, every poison record dead-lettered")
        engine_version = httpx.get(f"{deployment.engine}/health").json()["policy_version"]
        drained = {t.name: drain(deployment.bootstrap, t) for t in TOPICS.all()}  # the run is over: nothing moves
    finally:
        deployment.down()
    poison = {"landed": landed, "groups": poison_groups, "nan_group": nan_group, "letters": letters}
    audit(traffic, finished, drained, poison, engine_version, timeline, started)


def audit(traffic: Traffic, finished: dict[str, int], drained: dict, poison: dict, engine_version: int, timeline: list,
          started: float) -> None:
    """The delivery checks over the drained topics (see the module docstring); prints the counts first."""
    ledger = traffic.ledger
    landed, letters = poison["landed"], poison["letters"]
    completions = events(drained[TOPICS.completions.name])
    asked = [(REQUEST_ID.findall(c["messages_json"])[-1], c["session_id"]) for c in completions]
    recorded = Counter(request for request, _ in asked)
    session_of = dict(asked)
    spans = {e["event_id"] for e in events(drained[TOPICS.tool_spans.name])}
    grader_rewards = [e for e in events(drained[TOPICS.rewards.name]) if e["source"] != "processors"]
    finishes = {e["session_id"] for e in events(drained[TOPICS.sessions.name]) if "num_completions" in e}
    steps = events(drained[TOPICS.train_metrics.name])
    trained = Counter(g for step in steps for g in step["group_ids"])
    samples = [e for e in events(drained[TOPICS.samples.name]) if "sequences" in e]
    sample_ids = {}
    for s in samples:
        sample_ids.setdefault(s["group_id"], set()).add(s["event_id"])

    def duplicates(records: list[dict]) -> list[str]:
        return [i for i, n in Counter(r["event_id"] for r in records).items() if n > 1]

    # a reward posted with an Idempotency-Key and retried after a gateway kill is the same event twice (the
    # processors count it once); any other source event is written once
    retried = {i for i in duplicates(grader_rewards) if i in ledger.rewards}
    # forge.rewards also carries the processors' rewards: those are outputs, checked with the derived topics below
    source_dups = {t.name: [i for i in duplicates(grader_rewards if t == TOPICS.rewards else events(drained[t.name]))
                            if i not in retried] for t in SOURCES}
    derived = {t.name: [e for e in events(drained[t.name]) if t != TOPICS.rewards or e["source"] == "processors"]
               for t in (TOPICS.trajectories, TOPICS.samples, TOPICS.rewards)}
    derived_dups = {name: duplicates(records) for name, records in derived.items()}
    print(f"fault suite: {timeline[1:-1]} (seconds into the run); {time.monotonic() - started:.0f}s in all\n"
          f"  acknowledged: {len(ledger.completions)} completions, {len(ledger.spans)} spans, "
          f"{len(ledger.rewards)} rewards, {len(ledger.finished)} finishes ({ledger.retries} calls retried)\n"
          f"  recorded: {len(completions)} completions, {len(spans)} spans (of them unacknowledged, their answer "
          f"lost in a kill: {len(set(recorded) - set(ledger.completions))} and {len(spans - set(ledger.spans))}), "
          f"{len(grader_rewards)} grader rewards, {len(finishes)} finishes\n"
          f"  duplicate event ids: sources {sum(map(len, source_dups.values()))} (and {len(retried)} rewards "
          f"retried with the same Idempotency-Key), processor outputs re-emitted "
          f"{ {k: len(v) for k, v in derived_dups.items()} }\n"
          f"  groups finished {len(finished)}, samples {len(samples)} ({len(sample_ids)} groups), trained "
          f"{len(trained)} groups in {len(steps)} steps (engine at policy v{engine_version}), "
          f"poison dead-lettered {len(set(landed) & set(letters))} of {len(landed)}")

    assert ledger.retries > 0, "the kills never reached the agents"
    # acked is a subset of recorded
    lost = [r for r, session in ledger.completions.items() if session_of.get(r) != session]
    assert not lost, f"{len(lost)} acknowledged completions were not recorded: {lost[:5]}"
    assert set(ledger.spans) <= spans, "an acknowledged span was not recorded"
    assert set(ledger.rewards) <= {r["event_id"] for r in grader_rewards}, "an acknowledged reward was not recorded"
    assert set(ledger.finished) <= finishes, "an acknowledged finish was not recorded"
    # no duplicates: the gateway's idempotent producer never writes an event twice; a processor restart may
    # re-emit a group's outputs, but only as the identical records (deterministic ids and content)
    assert not any(source_dups.values()), source_dups
    for i in retried:
        copies = [{**r, "event_time": 0} for r in grader_rewards if r["event_id"] == i]
        assert all(c == copies[0] for c in copies), f"reward {i} retried with other content"
    assert [n for n in recorded.values() if n > 1] == [], "one request recorded twice"
    for name, records in derived.items():
        by_id: dict[str, dict] = {}
        for r in records:
            assert by_id.setdefault(r["event_id"], r) == r, f"{name}: event {r['event_id']} re-emitted differently"
    assert not duplicates(steps), "a TrainStep published twice"
    # every finished group: one sample, trained exactly once; nothing trained on poison
    assert len(finished) >= 10
    for group in finished:
        assert len(sample_ids.get(group, ())) == 1, f"group {group}: samples {sample_ids.get(group)}"
    assert all(n == 1 for n in trained.values()), [g for g, n in trained.items() if n > 1]
    assert set(finished) <= set(trained) and not set(poison["groups"]) & set(trained)
    assert poison["nan_group"] in trained, "the group that got a NaN reward was trained (on its real rewards)"
    assert all(math.isfinite(x) for s in samples for x in s["row_advantage"]), "a non-finite advantage was trained"
    assert all(g in traffic.tasks for g in trained), "a group that was never submitted was trained"
    assert engine_version >= 1 and all(s["loss"] == s["loss"] for s in steps), "the trainer really trained"
    sources = {t.name for t in SOURCES}
    assert all("processors.groups" in letters[where] for where in landed if where[0] in sources)
    assert all(letters[where] for where in landed), "a poison record was not dead-lettered"
    # the processors' outputs equal a batch recomputation from the source topics
    settings = ProcessorSettings()
    live = {}
    for records in derived.values():
        live.update((r["event_id"], r) for r in records)
    for group in finished:
        expected = {r["event_id"]: r for r in recompute(group, drained, settings)}
        published = {i: r for i, r in live.items() if r["group_id"] == group}
        assert expected and published == expected, f"group {group}: the processors' outputs differ from the batch"
        # and, from the reward functions themselves: each rollout's outcome is its acknowledged grade (never the
        # NaN), its reward-to-go and the group's advantages follow from its turns' rewards
        trajectories = [r for r in published.values() if "turns" in r]
        assert sorted(t["session_id"] for t in trajectories) == sorted(s for s, g in ledger.finished.items()
                                                                       if g == group)
        rewards = [[turn["reward"] for turn in t["turns"]] for t in trajectories]
        expected_advantages = advantages(rewards, settings.gamma, settings.advantage, settings.advantage_scale)
        for t, r, adv in zip(trajectories, rewards, expected_advantages):
            assert t["outcome_reward"] == ledger.outcomes[t["session_id"]]
            assert [turn["reward_to_go"] for turn in t["turns"]] == pytest.approx(reward_to_go(r, settings.gamma))
            assert [turn["advantage"] for turn in t["turns"]] == pytest.approx(adv)
