"""The OpenAI-style error body, `{"error": {"message", "type", "param", "code"}}`, built here alone: the gateway's
errors, both engines' (the torch engine's routes and stream errors, the vLLM front's), and the bearer-token check
they share answer with it."""

from __future__ import annotations

import orjson


def error_body(status: int, message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    """The JSON body of an error answered with HTTP `status`; `code` is OpenAI's error code where it has one (e.g.
    "context_length_exceeded"), else the status.

    >>> error_body(404, "No such session.", "not_found_error")
    b'{"error":{"message":"No such session.","type":"not_found_error","param":null,"code":404}}'
    """
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param,
                                   "code": status if code is None else code}})
