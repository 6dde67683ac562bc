"""The gateway's HTTP protocol (forge_stream.gateway.wire) answers a response in one write and loses nothing:
streamed chunks go out as they are sent, requests pipelined on one kept-alive connection are answered whole and in
order, and a response on a closing connection is written whole before the close."""

from __future__ import annotations

import asyncio
import socket
import threading

from helpers import serving
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from forge_stream.gateway.wire import CoalescingHttpToolsProtocol

WRITES: list[bytes] = []  # what reached the socket's transport, write by write
chunk_read = threading.Event()


class _Counted:
    """Records each write that reaches the socket's transport."""

    def __init__(self, transport):
        self._transport = transport

    def write(self, data):
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name):
        return getattr(self._transport, name)


class CountedCoalescing(CoalescingHttpToolsProtocol):
    def connection_made(self, transport):
        super().connection_made(_Counted(transport))


class CountedStock(HttpToolsProtocol):
    def connection_made(self, transport):
        super().connection_made(_Counted(transport))


async def answer(request):
    return JSONResponse({"id": request.query_params.get("id", "x"), "text": "forty-two" * 20})


async def stream(request):
    async def chunks():
        yield b"data: one\n\n"
        # the next chunk is made only once the client read the first: a first chunk held back hangs the test
        assert await asyncio.to_thread(chunk_read.wait, 30), "the client never got the first chunk"
        yield b"data: two\n\n"
        yield b"data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")


APP = Starlette(routes=[Route("/answer", answer), Route("/stream", stream)])


def _exchange(url: str, raw: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(raw)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return received


def test_a_response_goes_out_in_one_write():
    for protocol, writes in ((CountedCoalescing, 1), (CountedStock, 2)):  # uvicorn's own: head, then body
        with serving(APP, http=protocol) as url:
            WRITES.clear()
            answered = _exchange(url, b"GET /answer?id=7 HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        assert answered.startswith(b"HTTP/1.1 200 OK\r\n") and answered.endswith(b'"text":"' + b"forty-two" * 20
                                                                                 + b'"}')
        assert len(WRITES) == writes, (protocol.__name__, WRITES)
        assert b"".join(WRITES) == answered


def test_pipelined_requests_are_answered_whole_and_in_order():
    with serving(APP) as url:
        raw = b"".join(f"GET /answer?id={i} HTTP/1.1\r\nhost: t\r\n\r\n".encode() for i in range(5))
        answered = _exchange(url, raw + b"GET /answer?id=last HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    ids = [part.split(b'"')[0] for part in answered.split(b'{"id":"')[1:]]
    assert ids == [b"0", b"1", b"2", b"3", b"4", b"last"]
    assert answered.count(b"HTTP/1.1 200 OK\r\n") == 6


def test_a_streamed_chunk_goes_out_before_the_next_is_made():
    chunk_read.clear()
    with serving(APP) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:
            conn.sendall(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            received = b""
            while b"data: one" not in received:
                chunk = conn.recv(65536)
                assert chunk, "connection closed before the first chunk"
                received += chunk
            assert b"data: two" not in received
            chunk_read.set()
            while not received.endswith(b"0\r\n\r\n"):  # the chunked body's end
                chunk = conn.recv(65536)
                assert chunk, "connection closed before the stream's end"
                received += chunk
    assert received.index(b"data: one") < received.index(b"data: two") < received.index(b"data: [DONE]")
