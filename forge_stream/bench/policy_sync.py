"""How fast a published policy version reaches the rollouts, from events alone: `bench learning` reports it per seed
for full fine-tuning and LoRA alike.

- `sync_bytes`: the bytes of the weight files one version publishes (PolicyVersion.size_bytes, the median over the
  run's versions): the model's size for full weights, the adapter's with LoRA.
- `sync_s`: for each version some answer was served under, the seconds from its PolicyVersion's `event_time` (the
  trainer publishes it once the checkpoint is written) to the earliest moment the engine was seen serving it: the
  first token of a Completion labelled with that version (`first_token_ms`, streamed calls), or the end of one
  (`done_ms`, calls answered whole, which carry no first token); the median and the max over those versions.
  Versions no answer was served under (an engine skips to the newest version after a slow load) count in
  `sync_versions_unserved`.
"""

from __future__ import annotations

from statistics import median


def sync_summary(versions: list[dict], completions: list[dict]) -> dict:
    """`sync_bytes`, `sync_s` (median and max) and the version counts, from a run's PolicyVersions and the
    Completions served meanwhile (see the module docstring).

    >>> versions = [{"version": 1, "event_time": 1_000, "size_bytes": 9_800_000},
    ...             {"version": 2, "event_time": 5_000, "size_bytes": 9_800_000},
    ...             {"version": 3, "event_time": 6_000, "size_bytes": 9_800_000}]
    >>> answers = [{"policy_version": 0, "first_token_ms": 1_200}, {"policy_version": 1, "first_token_ms": 1_900},
    ...            {"policy_version": 1, "first_token_ms": None, "done_ms": 1_500},
    ...            {"policy_version": 3, "first_token_ms": 9_000, "done_ms": 9_100}]
    >>> sync_summary(versions, answers)
    {'sync_bytes': 9800000, 'sync_s': {'median': 1.75, 'max': 3.0}, 'sync_versions': 2, 'sync_versions_unserved': 1}
    """
    published: dict[int, int] = {}
    for record in versions:  # a version re-published after a trainer restart: its last record is the one served
        published[record["version"]] = record["event_time"]
    first: dict[int, int] = {}
    for answer in completions:
        version = answer["policy_version"]
        at = answer.get("first_token_ms") if answer.get("first_token_ms") is not None else answer.get("done_ms")
        if version in published and at is not None and (version not in first or at < first[version]):
            first[version] = at
    delays = [max(0, first[v] - published[v]) / 1000 for v in sorted(first)]
    sizes = [record.get("size_bytes", 0) for record in versions]
    return {"sync_bytes": int(median(sizes)) if sizes else None,
            "sync_s": {"median": round(median(delays), 3), "max": round(max(delays), 3)} if delays else None,
            "sync_versions": len(delays), "sync_versions_unserved": len(published) - len(delays)}
