"""Claim checks (forge_stream.events.claims): content-addressed payloads, verified on the way back."""

import pytest

from forge_stream.events import decode, encode
from forge_stream.events.claims import ClaimError, ClaimStore, claim_record, fetch, redeem
from forge_stream.processors.synthetic import group_events
from forge_stream.processors import ProcessorSettings, fold


def a_sample() -> dict:
    state, out = None, []
    for schema, record in group_events("claimed", group_size=2, turns=3):
        state, emits = fold(state, schema, record, ProcessorSettings())
        out += emits
    return next(e.record for e in out if e.schema == "TrainSample")


def test_a_payload_is_stored_once_under_its_hash_and_read_back_verified(tmp_path):
    store = ClaimStore(str(tmp_path / "claims"))
    first = store.put(b"payload")
    again = store.put(b"payload")
    assert first == again and first.uri.startswith("file://") and first.size_bytes == 7
    assert [p.name for p in (tmp_path / "claims").rglob("*") if p.is_file()] == [first.sha256]  # no partials left
    assert fetch(first.uri, first.sha256) == b"payload"
    (tmp_path / "claims" / first.sha256[:2] / first.sha256).write_bytes(b"tampered")
    with pytest.raises(ClaimError, match="does not match"):
        fetch(first.uri, first.sha256)


def test_a_sample_claim_redeems_to_the_exact_sample_and_is_plain_avro(tmp_path):
    sample = a_sample()
    payload = encode("TrainSample", sample)
    record = claim_record(sample, ClaimStore(f"file://{tmp_path}/claims").put(payload))
    schema, wire = decode(encode("SampleClaim", record))
    assert schema == "SampleClaim" and wire["group_id"] == sample["group_id"]
    assert wire["unique_tokens"] == sample["unique_tokens"] and wire["size_bytes"] == len(payload)
    assert redeem(wire) == decode(payload)[1]
    with pytest.raises(ClaimError, match="cannot read"):
        redeem({**wire, "uri": f"file://{tmp_path}/elsewhere/{wire['sha256']}"})
    other = ClaimStore(str(tmp_path / "claims")).put(encode("TrainSample", {**sample, "event_id": "other"}))
    with pytest.raises(ClaimError, match="not the claimed"):
        redeem({**wire, "uri": other.uri, "sha256": other.sha256})
