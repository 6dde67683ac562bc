"""A deployment's credentials: the gateway's admin token and the engines' token, and the rule that a service
listening beyond loopback has them.

`forge-stream up` generates them once per home (`credentials.json`, mode 0600, tokens from
`secrets.token_urlsafe`) and hands them to the services that use them in their environment: the gateway
(FORGE_GATEWAY_ADMIN_TOKEN, and FORGE_ENGINE_TOKEN for its calls to the engines), the engines (FORGE_ENGINE_TOKEN)
and the rollout controller (FORGE_GATEWAY_ADMIN_TOKEN). The command line's clients of a deployment (`rollout run`,
`eval`) read the home's file when no token is given. Agents never see these: they get their session's token.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path

from forge_stream.openai_error import error_body

GATEWAY_ENV = "FORGE_GATEWAY_ADMIN_TOKEN"
ENGINE_ENV = "FORGE_ENGINE_TOKEN"
SECRET_ENV = (GATEWAY_ENV, ENGINE_ENV)  # what an agent's environment never inherits from the controller's
FILE_NAME = "credentials.json"


@dataclass(frozen=True)
class Credentials:
    gateway_admin_token: str
    engine_token: str

    @classmethod
    def generate(cls) -> "Credentials":
        return cls(secrets.token_urlsafe(32), secrets.token_urlsafe(32))


def path(home: Path) -> Path:
    return home / FILE_NAME


def load(home: Path) -> Credentials | None:
    """The home's credentials, or None where `up` never generated them."""
    try:
        return Credentials(**json.loads(path(home).read_text()))
    except FileNotFoundError:
        return None


def ensure(home: Path) -> tuple[Credentials, bool]:
    """The home's credentials, generated (mode 0600, never readable by other users, not even for a moment) when
    there are none; and whether they were generated now. An existing file readable by others is made 0600."""
    found = load(home)
    if found is not None:
        os.chmod(path(home), 0o600)
        return found, False
    home.mkdir(parents=True, exist_ok=True)
    made = Credentials.generate()
    try:
        fd = os.open(path(home), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another `up` wrote them first
        return load(home), False
    with os.fdopen(fd, "w") as out:
        json.dump(asdict(made), out)
    return made, True


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this host alone.

    >>> [is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost", "0.0.0.0", "::", "", "10.0.0.5")]
    [True, True, True, True, False, False, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: whatever it resolves to may be reachable from elsewhere


def refuse_open_bind(service: str, host: str, token: str | None, env: str) -> None:
    """Raise ValueError when `service` would listen on `host`, beyond loopback, without a token."""
    if not token and not is_loopback(host):
        raise ValueError(f"{service} refuses to listen on {host!r} without credentials: anyone who reaches it could "
                         f"use it. Set {env} (`forge-stream up` generates it into its home's {FILE_NAME}), or bind "
                         "127.0.0.1.")


def agent_env(environ: dict[str, str]) -> dict[str, str]:
    """`environ` without the deployment's tokens: what an agent process inherits from the controller.

    >>> agent_env({"PATH": "/bin", GATEWAY_ENV: "secret", ENGINE_ENV: "secret"})
    {'PATH': '/bin'}
    """
    return {k: v for k, v in environ.items() if k not in SECRET_ENV}


def bearer(headers: dict[str, str]) -> str | None:
    """The token of `Authorization: Bearer ...` (header names lower-case), else None."""
    header = headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " and header.isascii() else None


class RequireBearer:
    """ASGI middleware: every HTTP request but those to `open_paths` needs `Authorization: Bearer <token>`; others
    are answered 401 with an OpenAI-style error body before the app sees them."""

    def __init__(self, app, token: str, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.token, self.open_paths = app, token, open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = bearer({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]})
            if not (given and hmac.compare_digest(given.encode(), self.token.encode())):
                body = error_body("This engine needs its token (Authorization: Bearer ...).", "AuthenticationError")
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
