"""Admission control of the gateway's OpenAI calls: at most `max_in_flight` are served at once (from the engine
call until their events are acknowledged by Kafka), at most `max_waiting` more wait for a slot, in arrival order.

A call past both bounds is shed at once with 429; a call that waited `max_wait_s` for a slot is shed with 503 (the
engine or Kafka is the limit: slots are not freeing). Both answers carry Retry-After and come before anything of
the call is recorded or any session state changes, so a client (the OpenAI SDK does by itself) retries it as is.
Admission is the first thing a call goes through after its token is checked: before its body is read and before its
session is rebuilt from Kafka (forge_stream.gateway.router), so a shed call costs neither memory nor broker reads.
"""

from __future__ import annotations

import asyncio

from forge_stream.events import now_ms
from forge_stream.gateway.protocol import GatewayError


class Admission:
    def __init__(self, max_in_flight: int, max_waiting: int, max_wait_s: float, retry_after_s: float):
        if max_in_flight < 1 or max_waiting < 0:
            raise ValueError("max_in_flight must be at least 1 and max_waiting at least 0")
        self._slots = asyncio.Semaphore(max_in_flight)
        self.max_in_flight, self.max_waiting, self.max_wait_s = max_in_flight, max_waiting, max_wait_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.waiting = 0
        self.shed = {429: 0, 503: 0}

    def _shed(self, status: int, message: str) -> GatewayError:
        self.shed[status] += 1
        kind = "rate_limit_error" if status == 429 else "service_unavailable"
        return GatewayError(status, message, kind, retry_after=self.retry_after_s)

    async def acquire(self) -> Lease:
        """Take a slot (waiting for one if needed), held until the returned lease is released."""
        asked = now_ms()
        if self._slots.locked() or self.waiting:
            if self.waiting >= self.max_waiting:
                raise self._shed(429, f"The gateway is at capacity ({self.in_flight} calls in flight, "
                                      f"{self.waiting} waiting); retry after the Retry-After delay.")
            self.waiting += 1
            try:
                async with asyncio.timeout(self.max_wait_s):
                    await self._slots.acquire()
            except TimeoutError:
                raise self._shed(503, f"No engine slot freed within {self.max_wait_s:g} s (the engine or Kafka is "
                                      f"the limit); retry after the Retry-After delay.") from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.in_flight += 1
        return Lease(self, asked)

    def _release(self) -> None:
        self.in_flight -= 1
        self._slots.release()

    def view(self) -> dict:
        return {"in_flight": self.in_flight, "waiting": self.waiting, "max_in_flight": self.max_in_flight,
                "max_waiting": self.max_waiting, "shed_429": self.shed[429], "shed_503": self.shed[503]}


class Lease:
    """One admitted call's slot. Released once, explicitly, or when the lease is dropped: a stream whose client
    left before its generator started never runs the generator's `finally`, but drops the lease with it."""

    def __init__(self, admission: Admission, asked_ms: int):
        self._admission: Admission | None = admission
        self.asked_ms = asked_ms  # when the call asked for its slot: when the gateway received it

    def release(self) -> None:
        admission, self._admission = self._admission, None
        if admission is not None:
            admission._release()

    def __del__(self):
        self.release()
