"""A pass-through proxy: the floor under the gateway's cost, for `forge-stream bench gateway --floor`.

It does what the gateway does on the wire and nothing more. The same server (uvicorn; with `--workers N`, N
processes each accepting on a socket of its own, as `gateway serve --workers N`) and the same engine client (an
aiohttp session set up as the gateway's). A chat request is forwarded with token ids and logprobs asked for, and the
answer is parsed and given back without them. At `/acked/...` it also writes the engine's answer to a scratch topic
with the gateway's producer (acks=all, idempotent, lz4, the same linger), keyed by one of 8 keys as the bench's 8
groups are, and answers once Kafka has acknowledged it. There is no session, no Completion event built or encoded,
and no check. So what `bench gateway` measures through the gateway beyond these two is the gateway's own work.

Run: python -m forge_stream.bench.passthrough --port P --engine URL [--bootstrap B --topic T] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os

import aiohttp
import orjson

from forge_stream.bench.scripted import reply_json
from forge_stream.gateway.completing import for_client, hidden_fields, upstream_body
from forge_stream.gateway.settings import GatewaySettings
from forge_stream.gateway.wire import CoalescingHttpToolsProtocol
from forge_stream.kafka.producer import EventProducer

_ENV = "FORGE_PASSTHROUGH"
_JSON = {"content-type": "application/json"}


class PassThrough:
    """The ASGI app: POST .../chat/completions forwarded to `engine`; under /acked/ its answer acknowledged by Kafka
    on `topic` first (needs `bootstrap`); GET answers 200 (health)."""

    def __init__(self, engine: str, bootstrap: str | None = None, topic: str | None = None,
                 linger_ms: float = GatewaySettings.linger_ms):
        self.engine, self.bootstrap, self.topic, self.linger_ms = engine.rstrip("/"), bootstrap, topic, linger_ms
        self.http: aiohttp.ClientSession | None = None
        self.producer: EventProducer | None = None
        self._keys = itertools.cycle([f"bench-{i}".encode() for i in range(8)])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            return await reply_json(send, 200, b'{"status":"ok"}')
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = orjson.loads(body)
        async with self.http.post(self.engine + "/v1/chat/completions", data=upstream_body("chat", request),
                                  headers=_JSON) as response:
            content = await response.read()
        if response.status != 200:
            return await reply_json(send, response.status, content)
        if scope["path"].startswith("/acked/"):
            await self.producer.send_raw(self.topic, next(self._keys), content)
        await reply_json(send, 200, orjson.dumps(for_client(orjson.loads(content), *hidden_fields("chat", request))))

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.http = aiohttp.ClientSession(  # as the gateway's (forge_stream.gateway.app), its defaults
                    connector=aiohttp.TCPConnector(limit=GatewaySettings.engine_connections), auto_decompress=False,
                    timeout=aiohttp.ClientTimeout(total=GatewaySettings.engine_timeout_s, connect=5.0))
                if self.bootstrap:
                    self.producer = EventProducer(self.bootstrap, **{"linger.ms": self.linger_ms})
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.http.close()
                if self.producer is not None:
                    await asyncio.to_thread(self.producer.close)
                await send({"type": "lifespan.shutdown.complete"})
                return


def from_env() -> PassThrough:
    """The app of one worker process (`--workers N`), with the arguments `main` was given."""
    return PassThrough(**json.loads(os.environ[_ENV]))


def main() -> None:
    import uvicorn

    from forge_stream.gateway.workers import bind_port, run_workers

    parser = argparse.ArgumentParser(description="A pass-through proxy: the gateway's wire work, nothing else.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--bootstrap", default=None, help="Kafka, for /acked/ (the answer written and acknowledged)")
    parser.add_argument("--topic", default=None)
    parser.add_argument("--linger-ms", type=float, default=GatewaySettings.linger_ms)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    os.environ[_ENV] = json.dumps({"engine": args.engine, "bootstrap": args.bootstrap, "topic": args.topic,
                                   "linger_ms": args.linger_ms})
    options = dict(host=args.host, port=args.port, log_level="warning", access_log=False,
                   http=CoalescingHttpToolsProtocol)  # the gateway's server
    if args.workers == 1:
        uvicorn.run(from_env(), **options)
        return
    run_workers(uvicorn.Config(f"{__name__}:from_env", factory=True, workers=args.workers, **options),
                bind_port(args.host, args.port))


if __name__ == "__main__":
    main()
