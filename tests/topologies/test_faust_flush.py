"""faust's producer buffer holds table changelog writes; a commit follows its flush, so the flush must not return
while writes are still queued (topologies.processors._DrainingBuffer)."""

import asyncio
from types import SimpleNamespace

from faust.transport.producer import ProducerBuffer

from topologies.processors import _DrainingBuffer


def run_flush(slow_s: float, messages: int, original: bool = False) -> tuple[int, int, float]:
    """Queue `messages` whose hand-over to the Kafka client takes `slow_s` each; flush; return (handed over when
    flush returned, still queued then, seconds flush took)."""
    async def scenario():
        handed = []
        buffer = ProducerBuffer()
        buffer.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))

        async def send(fut):  # the original hands over to aiokafka; here a slow hand-over under load
            await asyncio.sleep(slow_s)
            handed.append(fut)

        buffer.__dict__["_send_pending_inner"] = send
        await buffer.start()
        try:
            for i in range(messages):
                buffer.put(i)
            loop = asyncio.get_running_loop()
            started = loop.time()
            if original:  # faust's own ProducerBuffer.flush is exactly this call
                await buffer.flush_atmost(None)
            else:
                await buffer.flush()
            return len(handed), buffer.size, loop.time() - started
        finally:
            while buffer.size:
                await asyncio.sleep(0.01)
            await buffer.stop()

    return asyncio.run(scenario())


def _patch_inner_send(monkeypatch):
    """Route ProducerBuffer's original _send_pending to the per-buffer fake (the fix wraps whatever it finds)."""
    async def original(self, fut):
        await self._send_pending_inner(fut)

    monkeypatch.setattr(ProducerBuffer, "_send_pending", original)


def test_fausts_own_flush_returns_with_writes_still_queued(monkeypatch):
    """The reason for the fix, shown on faust itself: a flush on a slow hand-over returns early."""
    _patch_inner_send(monkeypatch)
    handed, queued, _ = run_flush(0.15, 4, original=True)
    assert queued > 0 and handed < 4


def test_the_fixed_flush_returns_only_when_every_write_was_handed_over(monkeypatch):
    _patch_inner_send(monkeypatch)
    monkeypatch.setattr(_DrainingBuffer, "installed", False)
    monkeypatch.setattr(ProducerBuffer, "flush", ProducerBuffer.flush)  # restored after the test
    _DrainingBuffer.install()
    handed, queued, took = run_flush(0.15, 4)
    assert (handed, queued) == (4, 0) and took >= 0.15 * 3
