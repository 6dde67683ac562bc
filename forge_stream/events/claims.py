"""Claim checks: an event too large to be one Kafka record travels by reference.

A group of long sessions packs into a prefix tree of millions of rows (about 24 bytes each as a TrainSample).
Kafka takes records that large only with every size limit raised, and then one record stalls its partition's
fetches, its replication and the memory of the windowed consumer that holds finished samples until the window
reaches them. So the processors publish a TrainSample whose encoding exceeds `claim_over_bytes` (1 MiB, Kafka's
own default record size) as a SampleClaim instead: the sample's header fields (what the scheduler orders and
bounds staleness by) plus the URI and SHA-256 of its encoded bytes in a content-addressed store. The trainer
fetches the payload only when the window hands the group over, and checks its hash.

Why a claim check rather than splitting the tree over several records: a group stays one record, so the
windowed FIFO, its watermark commits, the DLQ and replay keep their one-record-per-group logic, and no consumer
has to reassemble parts that may arrive interleaved with other groups or be cut by a crash between parts.
The store's names are the content's hash, so a replay of the processors writes the same object again (a no-op)
and emits an identical claim.

The store is any fsspec URL: a local directory by default (`FORGE_HOME/claims`, for one host), or an object
store every host can reach for a cluster (`s3://bucket/prefix` with s3fs, `gs://`, ...). Objects must be kept as
long as forge.samples keeps the claims (30 days) for replays to find them; `ClaimStore.collect` (`forge-stream
claims gc`) deletes the payloads no claim on the topic names any more, once older than a grace period.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import fsspec

CLAIM_OVER_BYTES = 1024 * 1024


class ClaimError(RuntimeError):
    """A claimed payload could not be read back, or its bytes do not match the claim's hash."""


@dataclass(frozen=True)
class Claim:
    uri: str
    sha256: str
    size_bytes: int


class ClaimStore:
    """Content-addressed payloads under one fsspec URL: `<root>/<sha[:2]>/<sha>`."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)

    def put(self, payload: bytes) -> Claim:
        """Store `payload` once (a payload already there is not written again); return where it is."""
        sha = hashlib.sha256(payload).hexdigest()
        path = f"{self.root}/{sha[:2]}/{sha}"
        if not self.fs.exists(path):
            self.fs.makedirs(f"{self.root}/{sha[:2]}", exist_ok=True)
            partial = f"{path}.{uuid.uuid4().hex}.partial"  # readers never see half an object
            with self.fs.open(partial, "wb") as out:
                out.write(payload)
            self.fs.mv(partial, path)
        return Claim(uri=self.fs.unstrip_protocol(path), sha256=sha, size_bytes=len(payload))


    def collect(self, referenced: set[str], grace_s: float = 86400.0, dry_run: bool = False,
                now: float | None = None) -> "Collected":
        """Delete the payloads whose hash no claim names any more (forge.samples' retention dropped their claims),
        and unfinished writes, once older than `grace_s`: a payload is stored before its claim is published, so a
        young unreferenced one may be about to be claimed. `dry_run` only counts."""
        now = time.time() if now is None else now
        deleted = deleted_bytes = kept = 0
        for info in self.fs.find(self.root, detail=True).values():
            name = info["name"].rsplit("/", 1)[-1]
            partial = name.endswith(".partial")
            if not partial and name in referenced:
                kept += 1
                continue
            modified = _modified(info)
            if modified is None or now - modified < grace_s:
                kept += 1
                continue
            if not dry_run:
                self.fs.rm(info["name"])
            deleted += 1
            deleted_bytes += int(info.get("size") or 0)
        return Collected(deleted, deleted_bytes, kept)


@dataclass(frozen=True)
class Collected:
    deleted: int
    deleted_bytes: int
    kept: int  # still referenced, or too young to tell


def _modified(info: dict) -> float | None:
    """An fsspec entry's modification time in epoch seconds (local: mtime; object stores: LastModified)."""
    value = info.get("mtime", info.get("LastModified", info.get("last_modified")))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) if value is not None else None


def fetch(uri: str, sha256: str) -> bytes:
    """The payload a claim names, verified against its hash (ClaimError says what went wrong and where)."""
    try:
        with fsspec.open(uri, "rb") as source:
            payload = source.read()
    except (OSError, ValueError, ImportError) as exc:
        raise ClaimError(f"cannot read the claimed payload {uri}: {exc} (is the claim store reachable from this "
                         f"host? a cluster needs a shared store: --claim-store s3://...)") from exc
    if hashlib.sha256(payload).hexdigest() != sha256:
        raise ClaimError(f"the payload at {uri} does not match its claim's sha256 {sha256}")
    return payload


def claim_record(sample: dict, claim: Claim) -> dict:
    """The SampleClaim for a TrainSample record stored as `claim`."""
    header = ("event_id", "event_time", "group_id", "task_id", "task_seq", "domain", "policy_version",
              "policy_version_max", "total_tokens", "unique_tokens", "group_complete")
    return {**{k: sample[k] for k in header}, "payload_schema": "TrainSample", "uri": claim.uri,
            "sha256": claim.sha256, "size_bytes": claim.size_bytes}


def redeem(record: dict) -> dict:
    """The TrainSample a SampleClaim stands for (fetched, verified, decoded); ClaimError if it cannot be had."""
    from forge_stream.events import DecodeError, decode

    payload = fetch(record["uri"], record["sha256"])
    try:
        schema, sample = decode(payload)
    except DecodeError as exc:
        raise ClaimError(f"the payload at {record['uri']} is not an event: {exc}") from exc
    if schema != record["payload_schema"] or sample["event_id"] != record["event_id"]:
        raise ClaimError(f"the payload at {record['uri']} is {schema} {sample.get('event_id')}, not the claimed "
                         f"{record['payload_schema']} {record['event_id']}")
    return sample
