"""A read-only Confluent Schema Registry API over the committed registry (`schemas/registry.json`).

Outside consumers (confluent-kafka's SchemaRegistryClient + AvroDeserializer, Kafka Connect, ksqlDB...) decode
forge-stream topics through it without any forge-stream code. Subjects follow two naming strategies: the record
name (`forge.events.Completion`, every version) and, for topics that carry one record type, `<topic>-value`.
Writes are refused: schemas change only by a commit to `schemas/`.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from forge_stream.events.registry import RegisteredSchema, SchemaRegistry, default_registry
from forge_stream.topics import TOPICS

MEDIA_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistryView:
    """Subjects and versions derived from the registry; pure, no HTTP."""

    def __init__(self, registry: SchemaRegistry):
        self.registry = registry
        self.subjects: dict[str, list[RegisteredSchema]] = dict(registry.versions)
        for topic in TOPICS.all():
            if len(topic.value_schemas) == 1:
                full = registry.latest(topic.value_schemas[0]).name
                self.subjects[f"{topic.name}-value"] = registry.versions[full]

    def version(self, subject: str, version: str) -> RegisteredSchema | None:
        versions = self.subjects[subject]
        if version in ("latest", "-1"):
            return versions[-1]
        return next((v for v in versions if str(v.version) == version), None)

    def subjects_of(self, schema_id: int) -> list[tuple[str, int]]:
        return [(subject, entry.version) for subject, entries in sorted(self.subjects.items())
                for entry in entries if entry.id == schema_id]


def _error(status: int, code: int, message: str) -> JSONResponse:
    return JSONResponse({"error_code": code, "message": message}, status_code=status, media_type=MEDIA_TYPE)


def _ok(body) -> JSONResponse:
    return JSONResponse(body, media_type=MEDIA_TYPE)


def create_app(registry: SchemaRegistry | None = None) -> FastAPI:
    app = FastAPI(title="forge-stream schema registry (read-only)")
    app.state.view = RegistryView(registry or default_registry())

    def view(request: Request) -> RegistryView:
        return request.app.state.view

    @app.get("/")
    def root():
        return _ok({})

    @app.get("/schemas/ids/{schema_id}")
    def schema_by_id(schema_id: int, request: Request):
        entry = view(request).registry.by_id.get(schema_id)
        if entry is None:
            return _error(404, 40403, f"Schema {schema_id} not found")
        return _ok({"schema": entry.schema_str})

    @app.get("/schemas/ids/{schema_id}/subjects")
    def subjects_by_id(schema_id: int, request: Request):
        found = view(request).subjects_of(schema_id)
        if not found:
            return _error(404, 40403, f"Schema {schema_id} not found")
        return _ok(sorted({subject for subject, _ in found}))

    @app.get("/schemas/ids/{schema_id}/versions")
    def versions_by_id(schema_id: int, request: Request):
        found = view(request).subjects_of(schema_id)
        if not found:
            return _error(404, 40403, f"Schema {schema_id} not found")
        return _ok([{"subject": s, "version": v} for s, v in found])

    @app.get("/subjects")
    def subjects(request: Request):
        return _ok(sorted(view(request).subjects))

    @app.get("/subjects/{subject}/versions")
    def versions(subject: str, request: Request):
        if subject not in view(request).subjects:
            return _error(404, 40401, f"Subject '{subject}' not found.")
        return _ok([entry.version for entry in view(request).subjects[subject]])

    @app.get("/subjects/{subject}/versions/{version}")
    def subject_version(subject: str, version: str, request: Request):
        v = view(request)
        if subject not in v.subjects:
            return _error(404, 40401, f"Subject '{subject}' not found.")
        entry = v.version(subject, version)
        if entry is None:
            return _error(404, 40402, f"Version {version} not found.")
        return _ok({"subject": subject, "version": entry.version, "id": entry.id, "schema": entry.schema_str})

    @app.get("/config")
    def config():
        return _ok({"compatibilityLevel": "BACKWARD"})

    @app.get("/{path:path}")
    def not_found(path: str):  # e.g. /associations/...: clients treat 404 as "none" and fall back
        return _error(404, 40400, f"/{path} is not served by forge-stream's read-only registry")

    @app.api_route("/{path:path}", methods=["POST", "PUT", "DELETE"])
    def read_only(path: str):
        return _error(405, 40501, "forge-stream's registry is read-only: schemas change by committing to "
                                  "schemas/ (then `forge-stream schemas register`)")

    return app
