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


def test_collect_deletes_only_old_payloads_no_claim_names(tmp_path):
    """Retention: a payload stays while a claim on forge.samples names it, and while it is younger than the grace
    (it is stored before its claim is published); an unfinished write left by a crash goes too, once old."""
    import os
    import time

    store = ClaimStore(str(tmp_path / "claims"))
    claimed, dropped, young = store.put(b"claimed"), store.put(b"dropped"), store.put(b"young")
    partial = tmp_path / "claims" / "ab" / "abcdef.1234.partial"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"half")
    old = time.time() - 3 * 86400
    for path in (tmp_path / "claims").rglob("*"):
        if path.is_file() and path.name != young.sha256:
            os.utime(path, (old, old))
    dry = store.collect({claimed.sha256}, grace_s=86400, dry_run=True)
    assert (dry.deleted, dry.kept) == (2, 2) and len([p for p in (tmp_path / "claims").rglob("*") if p.is_file()]) == 4
    done = store.collect({claimed.sha256}, grace_s=86400)
    assert (done.deleted, done.deleted_bytes, done.kept) == (2, len(b"dropped") + len(b"half"), 2)
    assert fetch(claimed.uri, claimed.sha256) == b"claimed" and fetch(young.uri, young.sha256) == b"young"
    with pytest.raises(ClaimError, match="cannot read"):
        fetch(dropped.uri, dropped.sha256)
    assert not partial.exists()


@pytest.mark.kafka
def test_claims_gc_keeps_what_forge_samples_still_claims(kafka_bootstrap, tmp_path):
    """`forge-stream claims gc` reads the claims on forge.samples and deletes only unclaimed old payloads."""
    import json
    import os
    import subprocess
    import sys
    import time

    from forge_stream.kafka.producer import EventProducer
    from forge_stream.topics import TOPICS

    store = ClaimStore(str(tmp_path / "claims"))
    sample = a_sample()
    payload = encode("TrainSample", sample)
    record = claim_record(sample, store.put(payload))
    orphan = store.put(b"a payload whose claim the topic's retention removed")
    producer = EventProducer(kafka_bootstrap)
    producer.produce(TOPICS.samples, record["group_id"], record, "SampleClaim")
    producer.close()
    old = time.time() - 2 * 86400
    for path in (tmp_path / "claims").rglob("*"):
        os.utime(path, (old, old))
    done = subprocess.run([sys.executable, "-m", "forge_stream", "claims", "gc", "--store", str(tmp_path / "claims"),
                           "-b", kafka_bootstrap, "--json"], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["deleted"] == 1 and result["kept"] >= 1 and result["referenced"] >= 1
    assert redeem(record) == decode(payload)[1]
    with pytest.raises(ClaimError):
        fetch(orphan.uri, orphan.sha256)
