"""`gateway serve --workers N`: N processes on one port under uvicorn's supervisor, each accepting from a listening
socket of its own.

uvicorn's workers share one listening socket, and each accepts what it can when the socket wakes them all, so
how new connections (a load balancer's pool, 64 agents starting) divide depends on which worker was free when they
came: in one run of `bench gateway` at 64 keep-alive callers one of two workers did twice the other's work (CPU
seconds) and ran out of CPU while the other waited (most runs split evenly). With one socket per worker on the port
(SO_REUSEPORT), the kernel hands each new connection to one of them by a hash of its addresses: an even share for
each worker, however the connections arrive.

The supervisor is uvicorn's (it restarts a worker that dies and stops them all on SIGINT/SIGTERM); it hands each
worker it spawns the sockets it was given, pickled. It is given one socket of the port, bound but never listening
(it holds the port, so a port in use fails at start, before any worker runs), whose pickle is a recipe: each worker
that unpickles it binds a new socket of its own to the same address. The cost of the kernel's choice: a worker that
stops resets the connections still waiting in its queue (accepted by no one yet), where a shared queue would be
drained by the others; a client retries those (the OpenAI SDK does, on connection errors).
"""

from __future__ import annotations

import socket

import uvicorn
from uvicorn.supervisors import Multiprocess


def _bound(sock: socket.socket, address: tuple) -> socket.socket:
    """`sock` bound to `address` with SO_REUSEPORT (other such sockets may share the port); closed if it cannot be."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _own_socket(family: int, address: tuple) -> socket.socket:
    """What a worker gets from unpickling the port: a socket of its own bound there."""
    return _bound(socket.socket(family, socket.SOCK_STREAM), address)


class _PortForEachWorker(socket.socket):
    """The port, bound with SO_REUSEPORT and not listening; a worker unpickling it binds a socket of its own there."""

    def __reduce__(self):
        return _own_socket, (self.family, self.getsockname()[:2])


def bind_port(host: str, port: int) -> socket.socket:
    """The port for `run_workers`, bound (SO_REUSEPORT) and not listening; OSError if it cannot be (in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bound(_PortForEachWorker(family, socket.SOCK_STREAM), (host, port))


def run_workers(config: uvicorn.Config, port: socket.socket) -> None:
    """Serve `config` (an import string app) with `config.workers` processes, each on its own socket of `port`
    (from `bind_port`, closed here); returns when they are stopped (SIGINT, SIGTERM)."""
    with port:
        Multiprocess(config, sockets=[port]).run()
