"""JSON request bodies read under explicit limits, for the gateway's and the engine's routes that parse their own
bodies: the size is checked while reading (before anything is parsed), the nesting depth right after parsing,
and large bodies are parsed in a worker thread so that the event loop keeps serving other requests.

`openapi_body` describes such a body in the app's OpenAPI schema (FastAPI cannot see it), so clients and
schema-driven tests (schemathesis) know its shape.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.requests import Request

PARSE_INLINE_BYTES = 64 * 1024  # smaller bodies are parsed on the event loop (a thread hop costs more)


class BodyRejected(Exception):
    """A body refused before it reached the route's logic: 413 (too large), 400 (not JSON, too deep)."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body; 413 as soon as it (or its declared Content-Length) passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyRejected(413, f"The request body of {declared} bytes is over this server's limit of {limit} "
                                f"bytes; send a smaller request (fewer or shorter prompts).")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyRejected(413, f"The request body is over this server's limit of {limit} bytes; send a "
                                    f"smaller request (fewer or shorter prompts).")
        chunks.append(chunk)
    return b"".join(chunks)


def nesting_depth_over(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests objects/arrays deeper than `limit` levels (walked without recursion).

    >>> nesting_depth_over({"a": [1, {"b": []}]}, 3), nesting_depth_over({"a": [1, {"b": []}]}, 4)
    (True, False)
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json(raw: bytes, max_depth: int) -> Any:
    """`raw` as JSON nested at most `max_depth` levels (400 otherwise)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyRejected(400, f"The request body is not valid JSON: {exc}") from exc
    if isinstance(value, (dict, list)) and nesting_depth_over(value, max_depth):
        raise BodyRejected(400, f"The request body nests JSON objects/arrays deeper than {max_depth} levels; "
                                f"flatten it (e.g. simpler tool parameter schemas).")
    return value


async def read_json(request: Request, max_bytes: int, max_depth: int) -> Any:
    """The body as JSON under both limits (parsed off the event loop when large)."""
    raw = await read_body(request, max_bytes)
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_json(raw, max_depth)
    return await asyncio.to_thread(parse_json, raw, max_depth)


def _inline_defs(schema: Any, defs: dict) -> Any:
    if isinstance(schema, dict):
        ref = schema.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline_defs(defs[ref[len("#/$defs/"):]], defs)
        return {k: _inline_defs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_defs(v, defs) for v in schema]
    return schema


def openapi_body(model: type[BaseModel] | dict) -> dict:
    """`openapi_extra` of a route that reads its own JSON body shaped like `model` (a pydantic model or a JSON
    schema); nested models are inlined, so the schema stands alone in the OpenAPI document."""
    schema = model.model_json_schema() if isinstance(model, type) else model
    schema = _inline_defs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}
