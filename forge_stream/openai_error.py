"""The OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`, built here alone: the gateway's
errors, both engines' (the torch engine's routes and stream errors, the vLLM front's), and the bearer-token check
they share answer with it."""

from __future__ import annotations

import orjson


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    """The JSON body of an error, in OpenAI's shape exactly: `code` is OpenAI's error code, a string, where it has
    one (e.g. "context_length_exceeded"), else null (the HTTP status is the answer's, not the body's).

    >>> error_body("No such session.", "not_found_error")
    b'{"error":{"message":"No such session.","type":"not_found_error","param":null,"code":null}}'
    """
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})
