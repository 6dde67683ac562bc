"""A group's state kept in small pieces: one header per group and one entry per event record it holds.

Faust writes a table value whole to its changelog on every update. Kept as one value, a group's state (every
completion, span and reward it collected) would be rewritten on each of its events: the changelog would grow with
the square of a session's turns, and a group holding one large request's completions would make a record over
Kafka's size limit, which crash-loops the worker at every restart. So the state is split:

    headers[group_id]              the state without its "completions", "spans" and "rewards" maps, plus
                                   "entries": how many entries the group has written (a closed marker as is);
    entries[f"{group_id}\x1f{i}"]  {"part": "completions" | "spans" | "rewards", "id": key, "record": record}
                                   for i in range(entries), in write order.

The two may be one table (the topology keeps both in `groups`, so there is one changelog to restore): an entry key
holds a separator that group ids cannot (`is_entry` tells them apart). The topology keeps its read marks there too
(`mark_key`: the last offset of each input partition folded into the table); `is_group` picks the headers out.

`load` rebuilds the state the pure fold (forge_stream.processors.fold) works on; `save` writes the header and
only the records the fold added or replaced, as new entries (a later entry of the same id wins on load, as the
fold's own replacement does). Per event that is one header (the group's sessions and task: independent of
turns) and at most the event's own record: the changelog grows linearly with what the group received. Closing a
group deletes its entries (tombstones on the compacted changelog) and leaves the closed marker; forgetting the
marker deletes the header.

A header that holds the whole state (one value, unsplit) is read as it is and split on its next save, so a
changelog written that way carries over.
"""

from __future__ import annotations

from collections.abc import MutableMapping

PARTS = ("completions", "spans", "rewards")
Snapshot = dict[str, dict[str, dict]]  # what load read, per part: the records the fold started from


SEPARATOR = "\x1f"  # ASCII unit separator: not in a group id (the gateway takes printable identifiers only)


def entry_key(group_id: str, index: int) -> str:
    return f"{group_id}{SEPARATOR}{index}"


def is_entry(key: str) -> bool:
    return SEPARATOR in key


MARK = "\x1e"  # ASCII record separator: starts a read mark's key


def mark_key(topic: str, partition: int) -> str:
    """The key of an input partition's read mark: the last offset of it whose record the table holds."""
    return f"{MARK}{topic}:{partition}"


def is_group(key: str) -> bool:
    """Whether a table key is a group's header (not an entry, not a read mark)."""
    return SEPARATOR not in key and not key.startswith(MARK)


class MissingEntry(LookupError):
    """A header counts an entry the table does not hold: state was lost (a changelog write that never reached
    Kafka, or a table restored from a changelog that was cut). The group cannot be folded correctly any more."""


class GroupStore:
    """Group states over two key-value tables (faust Tables in the topology; dicts in tests)."""

    def __init__(self, headers: MutableMapping, entries: MutableMapping):
        self.headers = headers
        self.entries = entries

    def load(self, group_id: str) -> tuple[dict | None, Snapshot]:
        """The group's whole state (None when it has none) and a snapshot of its records for `save`."""
        header = self.headers.get(group_id)
        if header is None or header.get("closed"):
            return header, {}
        if "entries" not in header:  # a whole state from before the split: split on save
            return dict(header), {}
        state = {k: v for k, v in header.items() if k != "entries"}
        parts: Snapshot = {part: {} for part in PARTS}
        for i in range(header["entries"]):
            entry = self.entries.get(entry_key(group_id, i))
            if entry is None:
                raise MissingEntry(f"group {group_id!r}: its header counts {header['entries']} entries but entry {i} "
                                   "is not in the table (state lost from the changelog); the group's events are "
                                   "dead-lettered from here on: replay them into a fresh app id to rebuild it")
            parts[entry["part"]][entry["id"]] = entry["record"]
        state.update(parts)
        return state, {part: dict(records) for part, records in parts.items()}

    def save(self, group_id: str, state: dict | None, snapshot: Snapshot) -> None:
        """Write what the fold changed: the header, the new or replaced records, and on close the tombstones."""
        held = self.headers.get(group_id)
        if held is not None and held is state:  # a closed marker the fold left as it was
            return
        written = held.get("entries", 0) if held else 0
        if state is None or state.get("closed"):
            for i in range(written):
                self.entries.pop(entry_key(group_id, i), None)
            if state is None:
                self.headers.pop(group_id, None)
            else:
                self.headers[group_id] = state
            return
        count = written
        for part in PARTS:
            before = snapshot.get(part, {})
            for key, record in state[part].items():
                held_record = before.get(key)
                if held_record is not record and held_record != record:
                    self.entries[entry_key(group_id, count)] = {"part": part, "id": key, "record": record}
                    count += 1
        header = {k: v for k, v in state.items() if k not in PARTS}
        self.headers[group_id] = {**header, "entries": count}

