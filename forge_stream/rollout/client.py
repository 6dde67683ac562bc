"""The controller's side of the gateway's session routes, each call retried with backoff.

Transport errors (connection refused or reset, read errors, timeouts) and answers 429 or 5xx are retried a few
times with exponential backoff; anything else is the gateway's final word. A call that still fails raises
`GatewayCallError` naming the URL it called, which the controller turns into one failed session, never a failed
run.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 0.2  # doubled after each failed try
    max_backoff_s: float = 5.0

    def delay(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** attempt, self.max_backoff_s)


class GatewayCallError(RuntimeError):
    """A session call that failed for good (after retries, or refused with a 4xx)."""


def _retriable(status: int) -> bool:
    return status == 429 or status >= 500


class GatewayClient:
    def __init__(self, url: str, admin_token: str | None = None, retry: RetryPolicy = RetryPolicy(),
                 timeout_s: float = 60.0):
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.url = url.rstrip("/")
        self.retry = retry
        self.http = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s)

    async def _call(self, method: str, path: str, body: dict | None = None,
                    headers: dict[str, str] | None = None) -> httpx.Response:
        error = ""
        for attempt in range(self.retry.attempts):
            try:
                response = await self.http.request(method, path, json=body, headers=headers)
            except httpx.TransportError as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                if not _retriable(response.status_code):
                    return response
                error = f"HTTP {response.status_code}: {response.text[:200]}"
            if attempt + 1 < self.retry.attempts:
                await asyncio.sleep(self.retry.delay(attempt))
        raise GatewayCallError(f"{method} {self.url}{path} failed {self.retry.attempts} times; last: {error}")

    @staticmethod
    def _refused(action: str, response: httpx.Response) -> GatewayCallError:
        return GatewayCallError(f"gateway refused {action}: HTTP {response.status_code} {response.text[:300]}")

    async def open(self, session_id: str, task_id: str, group_id: str, metadata: dict[str, str]) -> dict:
        """Open a session with a chosen id; returns the gateway's answer (base_url, token...). A retry whose first
        try was recorded (its answer lost) gets the same session (200)."""
        response = await self._call("POST", "/v1/sessions", {"session_id": session_id, "task_id": task_id,
                                                             "group_id": group_id, "metadata": metadata})
        if response.status_code not in (200, 201):
            raise self._refused(f"opening session {session_id}", response)
        return response.json()

    async def reward(self, session_id: str, body: dict, key: str) -> None:
        """Post a reward under an idempotency key: the retries of one post are one event (counted once)."""
        response = await self._call("POST", f"/v1/sessions/{session_id}/reward", body, {"Idempotency-Key": key})
        if response.status_code != 200:
            raise self._refused(f"a reward for session {session_id}", response)

    async def finish(self, session_id: str, status: str, reason: str | None) -> None:
        """Finish a session; one already finished (409, e.g. by an earlier try whose answer was lost) is done."""
        response = await self._call("POST", f"/v1/sessions/{session_id}/finish", {"status": status, "reason": reason})
        if response.status_code not in (200, 409):
            raise self._refused(f"finishing session {session_id}", response)

    async def status(self, session_id: str) -> str | None:
        """The session's status (open, finishing, finished), or None if the gateway does not know it."""
        response = await self._call("GET", f"/v1/sessions/{session_id}")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise self._refused(f"reading session {session_id}", response)
        return response.json()["status"]

    async def aclose(self) -> None:
        await self.http.aclose()
