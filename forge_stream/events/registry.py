"""The schema registry: every Avro event contract under `schemas/`, with the fixed ids of `registry.json`.

The registry file is the single source of schema ids. Each entry names a record, its version, the `.avsc` file
and the SHA-256 of the schema's Parsing Canonical Form. Loading checks every fingerprint, so a schema file edited
in place (instead of being added as a new version with a new id) fails loudly at start-up, not on the wire.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from forge_stream.shipped import shipped

SCHEMAS_DIR = shipped("schemas")
REGISTRY_FILE = SCHEMAS_DIR / "registry.json"


class RegistryError(RuntimeError):
    """The committed registry and the schema files disagree."""


@dataclass(frozen=True)
class RegisteredSchema:
    id: int
    name: str  # fully qualified record name, e.g. forge.events.Completion
    version: int
    file: str
    schema_str: str  # the .avsc text as committed (what the HTTP registry serves)
    parsed: dict

    @property
    def short_name(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @cached_property
    def writer(self) -> dict:
        """`parsed` marked as parsed for fastavro's writers, which otherwise parse the schema again on every
        record (a third of the time to encode a Completion)."""
        return fastavro.parse_schema(self.parsed)

    @property
    def canonical(self) -> str:
        return to_parsing_canonical_form(self.parsed)


def schema_fingerprint(parsed: dict) -> str:
    return fingerprint(to_parsing_canonical_form(parsed), "SHA-256")


class SchemaRegistry:
    """All registered schemas, by id and by name; the latest version of a name is its reader schema."""

    def __init__(self, entries: list[RegisteredSchema]):
        self.by_id: dict[int, RegisteredSchema] = {}
        self.versions: dict[str, list[RegisteredSchema]] = {}
        for entry in sorted(entries, key=lambda e: (e.name, e.version)):
            if entry.id in self.by_id:
                raise RegistryError(f"schema id {entry.id} is registered twice")
            self.by_id[entry.id] = entry
            self.versions.setdefault(entry.name, []).append(entry)
        self._short = {name.rsplit(".", 1)[-1]: name for name in self.versions}

    def latest(self, name: str) -> RegisteredSchema:
        """The newest version of a record, by full or short name ("Completion")."""
        full = self._short.get(name, name)
        try:
            return self.versions[full][-1]
        except KeyError:
            known = ", ".join(sorted(self._short))
            raise KeyError(f"no schema named {name!r}; known: {known}") from None

    def names(self) -> list[str]:
        return sorted(self.versions)


def _without_logical_types(node):
    """forge-stream code works with epoch milliseconds as ints: read `timestamp-millis` as its plain long.

    The logical type stays in the served schema text (outside consumers get datetimes) and does not enter the
    Parsing Canonical Form, so fingerprints are the same either way.
    """
    if isinstance(node, dict):
        return {k: _without_logical_types(v) for k, v in node.items() if k != "logicalType"}
    if isinstance(node, list):
        return [_without_logical_types(v) for v in node]
    return node


def parse(text: str) -> dict:
    return fastavro.parse_schema(_without_logical_types(json.loads(text)), _write_hint=False, _force=True)


def _load_entry(raw: dict, schemas_dir: Path) -> RegisteredSchema:
    path = schemas_dir / raw["file"]
    text = path.read_text()
    parsed = parse(text)
    actual = schema_fingerprint(parsed)
    if actual != raw["fingerprint"]:
        raise RegistryError(
            f"{raw['file']} changed but registry.json still pins id {raw['id']} to its old form. "
            "Schemas evolve by adding a new version: copy the old file to schemas/history/, then run "
            "`forge-stream schemas register` to give the new form a new id."
        )
    return RegisteredSchema(raw["id"], raw["name"], raw["version"], raw["file"], text, parsed)


def load_registry(schemas_dir: Path = SCHEMAS_DIR) -> SchemaRegistry:
    raw = json.loads((schemas_dir / "registry.json").read_text())
    return SchemaRegistry([_load_entry(entry, schemas_dir) for entry in raw["schemas"]])


@cache
def default_registry() -> SchemaRegistry:
    return load_registry()


def register(schemas_dir: Path = SCHEMAS_DIR) -> list[str]:
    """Give every new or changed `.avsc` under `schemas_dir` a new id and version in registry.json.

    A changed file's old version must already be kept under `history/` (same fingerprint); its entry is repointed
    there, so old bytes on the topics still decode. Returns one line per change.
    """
    registry_path = schemas_dir / "registry.json"
    entries = json.loads(registry_path.read_text())["schemas"] if registry_path.exists() else []
    history = {
        schema_fingerprint(parse(p.read_text())): p
        for p in sorted((schemas_dir / "history").glob("*.avsc"))
    }
    known = {e["fingerprint"] for e in entries}
    changes = []
    for path in sorted(schemas_dir.glob("*.avsc")):
        parsed = parse(path.read_text())
        fp = schema_fingerprint(parsed)
        if fp in known:
            continue
        for old in (e for e in entries if e["file"] == path.name):
            if old["fingerprint"] not in history:
                raise RegistryError(
                    f"{path.name} changed, but its registered version {old['version']} (id {old['id']}) is not kept "
                    f"under {schemas_dir / 'history'}: restore it there (git show HEAD:schemas/{path.name}) first"
                )
            old["file"] = str(history[old["fingerprint"]].relative_to(schemas_dir))
        name = parsed["name"]
        version = 1 + max((e["version"] for e in entries if e["name"] == name), default=0)
        entry = {"id": 1 + max((e["id"] for e in entries), default=0), "name": name, "version": version,
                 "file": path.name, "fingerprint": fp}
        entries.append(entry)
        known.add(fp)
        changes.append(f"{name} v{version} -> id {entry['id']} ({path.name})")
    registry_path.write_text(json.dumps({"schemas": entries}, indent=2) + "\n")
    return changes
