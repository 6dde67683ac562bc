"""The load balancer in front of several gateway hosts: HAProxy run from the shipped config
(infra/haproxy/gateway.cfg), which sends every call of a session to one host by a consistent hash of its id and
takes a host that stops answering /health out, moving its sessions (and only those) to the others.

This module fills the config's template with the gateway hosts and runs haproxy in the foreground (`forge-stream
gateway balance`, the `load_balancer` service of a topology); the routing itself is HAProxy's.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from string import Template

from forge_stream.shipped import shipped

CONFIG_TEMPLATE = shipped("infra/haproxy/gateway.cfg")


class _Placeholders(Template):
    """The config's placeholders are `@@name` (HAProxy's own syntax uses `$` and `%`)."""

    delimiter = "@@"


INSTALL_HINT = "install HAProxy (Debian/Ubuntu: apt-get install -y haproxy) or put it on PATH"


def render(backends: list[str], *, bind: str = "127.0.0.1", port: int = 8000, check_ms: int = 1000) -> str:
    """The shipped config for gateway hosts `backends` ("host:port" each; their order names them gw-0, gw-1, ...),
    listening on `bind`:`port`, checking each host's /health every `check_ms`."""
    if not backends:
        raise ValueError("the load balancer needs at least one gateway host (host:port)")
    for backend in backends:
        host, _, port_text = backend.rpartition(":")
        if not host or not port_text.isdigit():
            raise ValueError(f"gateway host {backend!r}: give it as HOST:PORT, e.g. gw-0:8000")
    servers = "\n".join(f"    server gw-{i} {backend} check" for i, backend in enumerate(backends))
    return _Placeholders(CONFIG_TEMPLATE.read_text()).substitute(bind=bind, port=port, check_ms=check_ms,
                                                           servers=servers)


def haproxy_argv(config: Path) -> list[str]:
    """HAProxy in the foreground (-db: no daemon, so a supervisor holds it) on `config`; ValueError without it."""
    binary = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)
    if binary is None:
        raise ValueError(f"haproxy not found: {INSTALL_HINT}")
    return [binary, "-db", "-f", str(config)]


def serve(backends: list[str], config: Path, *, bind: str, port: int, check_ms: int) -> None:
    """Write the config for `backends` to `config` and become haproxy on it (exec: signals reach HAProxy)."""
    argv = haproxy_argv(config)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(render(backends, bind=bind, port=port, check_ms=check_ms))
    os.execv(argv[0], argv)
