"""The committed registry guards the ids: editing a schema in place fails; `register` adds a new version."""

import json
import shutil

import pytest

from forge_stream.events.registry import SCHEMAS_DIR, RegistryError, load_registry, register


@pytest.fixture
def schemas(tmp_path):
    copy = tmp_path / "schemas"
    shutil.copytree(SCHEMAS_DIR, copy)
    return copy


def test_committed_registry_is_complete(schemas):
    assert register(schemas) == []  # every .avsc file is registered as it is


def test_editing_a_schema_in_place_fails_loudly(schemas):
    path = schemas / "reward.avsc"
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "extra", "type": "string", "default": ""})
    path.write_text(json.dumps(schema))
    with pytest.raises(RegistryError, match="reward.avsc changed"):
        load_registry(schemas)
    with pytest.raises(RegistryError, match="not kept"):
        register(schemas)


def test_register_adds_a_version_and_keeps_the_old_one_readable(schemas):
    path = schemas / "reward.avsc"
    shutil.copy(path, schemas / "history" / "reward.v1.avsc")
    schema = json.loads(path.read_text())
    schema["fields"].append({"name": "extra", "type": "string", "default": ""})
    path.write_text(json.dumps(schema))
    changes = register(schemas)
    assert changes == ["forge.events.Reward v2 -> id 31 (reward.avsc)"]
    registry = load_registry(schemas)
    versions = registry.versions["forge.events.Reward"]
    assert [(v.version, v.id, v.file) for v in versions] == [(1, 6, "history/reward.v1.avsc"), (2, 31, "reward.avsc")]
