"""uvicorn's HTTP/1.1 protocol (httptools), answering each response in one write to the socket.

uvicorn writes a response's status line and headers when the app sends `http.response.start`, and its body when the
app sends `http.response.body`: two writes to the socket, so two TCP segments, and a client that reads the first before
the second arrives wakes twice for one answer. An agent's call is answered with one start and one body, sent in the
same step of the app's task; `CoalescingHttpToolsProtocol` gives each request's cycle a transport that holds what is
written during one step of the event loop and writes it at the end of that step, in one call. With it, `bench
gateway --workers 2` run side by side shows the gateway's CPU per call about 8% lower and the load client's about
a third lower (docs/benchmarks/exploratory.md). A streamed answer's chunks are written as they come, each at the end
of the loop step that sent it (chunks sent in one step go out together); nothing waits past the step it was written
in. Backpressure is the real transport's: its buffer pauses the protocol (uvicorn's flow control) when a flush fills
it.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _StepWrites:
    """A transport whose writes are joined and written at the end of the event loop's step; `close` writes what is
    held first. Everything else is the socket's transport's."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(data)

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose responses go out in one write (`_StepWrites`): pass it as uvicorn's
    `http` option."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _StepWrites(transport, self.loop)
