"""The event contracts: round trips, pinned fingerprints, evolution, and clear errors on bad bytes."""

import json
import struct

import pytest
from fastavro.utils import generate_one

from forge_stream.events import DecodeError, decode, default_registry, encode, peek
from forge_stream.events.registry import schema_fingerprint

# SHA-256 of each schema's Parsing Canonical Form. A change here is a contract change: add a new version instead.
PINNED = {
    ("forge.events.Completion", 1): "8054d812ef54efd3f1ee9d473e74909b78b2174ed23fd34433b2520c1856c8fc",
    ("forge.events.Completion", 2): "c61b851b5ccff8b2f72685419c6a5f224a263bc17c08e90e357b61eb55e0c362",
    ("forge.events.Completion", 3): "26e62c5d1ce0a31befee8f9ce221a2b1e2e7310f6a5148df527a83f657ed4d7c",
    ("forge.events.Completion", 4): "6a64a42787acd767e5121752a51f73e4f0de95c1c4d2cd0cfd65fb70679948cb",
    ("forge.events.Completion", 5): "2fda9fc3e44bfa513d88c7df854628d315cfacfa97623f490c183713decfab91",
    ("forge.events.Completion", 6): "1a056b1f1082d70ec4a3a85e90662b68f0870271fa2aa4efd52f8379fba872af",
    ("forge.events.Completion", 7): "8ce6fa99cdb093c9bc91cc8123a157a4e6feeee24fa0e450cfdcdbbb6c49f3e3",
    ("forge.events.DeadLetter", 1): "9f26aa83e8eedaff91b8d9b5850fe1c340d16b71ebce0e902a4d3c5e6f338896",
    ("forge.events.EvalResult", 1): "2cd0d18a2b0464cc88fc29999e7e4542bbf9c2f3126ac0142e792dff1a08a8e0",
    ("forge.events.GroupSkipped", 1): "4485c2fcdfe18b99f425a68132167f4974464dbc6744f127994faf482b3fe5cc",
    ("forge.events.GroupSkipped", 2): "c2e861c667f411dd8d3f2b4b330fda2d97a1ea67e2207fe46dcba08d2aced58e",
    ("forge.events.PolicyVersion", 1): "d2d014ebd21d53644e7a5ecdd79c648fbf91e7afda67f9a618f201efc0a2e5f3",
    ("forge.events.PolicyVersion", 2): "71a8a1157f21787d4f15479f95b7e5b112bfafe87fd805ff0907f81bedd878aa",
    ("forge.events.Reward", 1): "21a2a9cb7fc66d5a4bfaf740774eca356396a135dd53a29fc40124161724999b",
    ("forge.events.SessionFinished", 1): "709a7e33d2bf557a2388cfabd6c507828bd05f291d4fa7a8ae834a0869cf4f81",
    ("forge.events.SessionFinished", 2): "a3eb4710df587592a12e2443446070637e5b170c43acaf6bdd6edf75fee8dae4",
    ("forge.events.SessionStarted", 1): "4d0916489d6066add20536c15ed3b048eee4d988f66cb39acfcc4a1c396f059c",
    ("forge.events.Task", 1): "614b9c7165f22c98b753a948a46c4c6171124e2450e1096744db93dd94b5c90e",
    ("forge.events.Task", 2): "7740977e0207cd48f991c1ae35479bd97c8bd02d75a0100d504a6fdce06c276e",
    ("forge.events.ToolSpan", 1): "3c71316efb46cca4789376d2f0fe9bec60f14219b8979d7dd1be937c5dabf3cd",
    ("forge.events.ToolSpan", 2): "8b6c89134b91fa95725ae3a5b805055a94216e3d1f47c67450added661d0fde8",
    ("forge.events.SampleClaim", 1): "560ad099f01b51f5382f270219fa5dae85241a814aff55b084e80c9792ad1f73",
    ("forge.events.TrainSample", 1): "bbfce5a609ae429d26b204647201823b97917e719707bc04436c3565c477072a",
    ("forge.events.TrainSample", 2): "df5902a4569ccf150aa4aeaf3c35dc74d774f654cfef04091d23faf28531dac2",
    ("forge.events.TrainSample", 3): "f88f043d59f123b5384c99b08e478dac025a72ff7b745b0a8ffc1e8181de74a3",
    ("forge.events.TrainStep", 1): "79e57c0dc8e159429f9560b53d98106d817ba3916ce4fad9fc4f4176ed824147",
    ("forge.events.TrainStep", 2): "a07ab1d2490f0c07621610b00434396b7a6c269556a7621dde642330a48ab709",
    ("forge.events.TrainStep", 3): "72f2ba2d2a2e8d800a34fb9586785333385fd7fd8d874c5fb07db5908f8a09a2",
    ("forge.events.TrainStep", 4): "8c939d682167a20a96ae2562c1861d5ace295594ab842543453fbffcb6fccca1",
    ("forge.events.Trajectory", 1): "00e7aa2e07a78a4a4c8b1b4b56189c93e67685f74254c8608f05c5dd00c443a6",
    ("forge.events.Trajectory", 2): "36f0da630d62ac14e0bf15f326e6f66690b67ffde5ba014bdb3cc1dabf9605fe",
    ("forge.events.Trajectory", 3): "99aca2af7fee774210e7a3f6c2f62726f49b025b8daf7726364d60ab31f99606",
    ("forge.events.Trajectory", 4): "cad2378bf731ee04095dc7d6502857e0a77db8349781fe29715a42c6a046de00",
}
EVENTS = ["Task", "SessionStarted", "SessionFinished", "Completion", "ToolSpan", "Reward", "Trajectory",
          "TrainSample", "GroupSkipped", "PolicyVersion", "TrainStep", "EvalResult", "DeadLetter"]


def test_every_design_event_has_a_schema_with_identity_and_time():
    registry = default_registry()
    for name in EVENTS:
        fields = {f["name"]: f for f in json.loads(registry.latest(name).schema_str)["fields"]}
        assert fields["event_id"]["type"] == "string"
        assert fields["event_time"]["type"] == {"type": "long", "logicalType": "timestamp-millis"}


def test_fingerprints_are_pinned():
    registry = default_registry()
    actual = {(e.name, e.version): schema_fingerprint(e.parsed) for e in registry.by_id.values()}
    assert actual == PINNED


def test_event_time_reads_as_epoch_millis():
    record = generate_one(default_registry().latest("Task").parsed)
    record["event_time"] = 1_764_000_000_123
    assert decode(encode("Task", record))[1]["event_time"] == 1_764_000_000_123


@pytest.mark.parametrize("name", EVENTS)
def test_round_trip(name):
    entry = default_registry().latest(name)
    for _ in range(5):
        record = generate_one(entry.parsed)
        data = encode(name, record)
        assert data[0] == 0 and struct.unpack(">I", data[1:5])[0] == entry.id
        decoded_name, decoded = decode(data)
        assert decoded_name == name
        assert decoded == _as_read(record, decoded)


@pytest.mark.parametrize("name", EVENTS)
def test_peek_reads_the_fields_decode_reads(name):
    """Leading fields read without decoding the rest, and (past a field peek cannot skip) by decoding: same values."""
    entry = default_registry().latest(name)
    names = tuple(f["name"] for f in entry.parsed["fields"])
    for _ in range(5):
        data = encode(name, generate_one(entry.parsed))
        _, decoded = decode(data)
        for wanted in (names[:1], names[:3], (names[2], names[0]), names):
            assert peek(data, wanted) == (name, {f: decoded[f] for f in wanted})
    with pytest.raises(DecodeError):
        peek(encode(name, generate_one(entry.parsed))[:6], names[:2])


def _as_read(record, decoded):
    """Avro floats are 32-bit: compare float fields after the same rounding."""
    import numpy as np

    def norm(value, like):
        if isinstance(value, float) and isinstance(like, float):
            return float(np.float32(value)) if float(np.float32(value)) == like else value
        if isinstance(value, dict):
            return {k: norm(v, like.get(k)) for k, v in value.items()}
        if isinstance(value, list):
            return [norm(v, w) for v, w in zip(value, like)]
        return value

    return norm(record, decoded)


def test_old_version_is_read_with_the_new_one():
    registry = default_registry()
    old = registry.versions["forge.events.Completion"][0]
    assert old.version == 1 and "agent" not in {f["name"] for f in old.parsed["fields"]}
    record = generate_one(old.parsed)
    import io

    from fastavro import schemaless_writer

    buf = io.BytesIO()
    buf.write(struct.pack(">bI", 0, old.id))
    schemaless_writer(buf, old.parsed, record)
    name, decoded = decode(buf.getvalue())
    assert name == "Completion"
    assert decoded["agent"] == ""  # the evolved field's default
    assert decoded["completion_id"] == record["completion_id"]
    assert decoded["prompt_token_ids"] == record["prompt_token_ids"]


def test_writers_use_the_latest_version():
    record = generate_one(default_registry().latest("Completion").parsed)
    assert struct.unpack(">I", encode("Completion", record)[1:5])[0] == default_registry().latest("Completion").id


def test_bad_bytes_raise_clear_errors():
    good = encode("Reward", generate_one(default_registry().latest("Reward").parsed))
    with pytest.raises(DecodeError, match="bad magic byte"):
        decode(b"\x01" + good[1:])
    with pytest.raises(DecodeError, match="unknown schema id 999"):
        decode(b"\x00" + struct.pack(">I", 999) + good[5:])
    with pytest.raises(DecodeError, match="too short"):
        decode(b"\x00\x00")
    with pytest.raises(DecodeError, match="corrupt"):
        decode(good[:8])
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode(good + b"\x00\x01")
    with pytest.raises(DecodeError, match="bad magic byte"):
        decode(b'{"json": true}')


def test_encoding_a_wrong_record_names_the_schema():
    with pytest.raises(ValueError, match="forge.events.Reward"):
        encode("Reward", {"event_id": "x"})
    with pytest.raises(KeyError, match="known:"):
        encode("Nope", {})
