"""The fault suite's agents: scripted rollouts through the gateway, with a ledger of what it acknowledged.

Each group is one Task (produced by a patient producer, as the rollout controller does) and `group_size`
sessions of two chat turns. After the first turn a session posts an explicit tool span, after the second its
outcome reward (Idempotency-Key: a retried post is the same event), then it finishes. Every chat call carries a
unique request id (`req-N`) in its last user message, which the gateway records in the Completion's
messages_json; a call that fails (connection error, 5xx, 429 while a service is down) is retried as a new request
with a new id, since the gateway does not deduplicate completions. Only answers the gateway gave are entered in
the ledger: a 200 chat call (its request id), the event ids of a span or reward it returned.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from dataclasses import dataclass, field

import httpx

from forge_stream.events import new_event_id, now_ms
from forge_stream.kafka.producer import EventProducer
from forge_stream.topics import TOPICS

RETRY_FOR_S = 180.0  # a call is retried this long (a broker restart with every client reconnecting fits)


@dataclass
class Ledger:
    """What the gateway acknowledged, by session."""

    opened: dict[str, dict] = field(default_factory=dict)  # session id -> its session_id, group_id, task_id
    completions: dict[str, str] = field(default_factory=dict)  # request id -> session id (a 200 chat answer)
    spans: dict[str, str] = field(default_factory=dict)  # event id -> session id
    rewards: dict[str, str] = field(default_factory=dict)  # event id -> session id
    finished: dict[str, str] = field(default_factory=dict)  # session id -> group id
    groups: dict[str, int] = field(default_factory=dict)  # group id -> seq, for groups whose sessions all finished
    outcomes: dict[str, float] = field(default_factory=dict)  # session id -> its outcome reward
    retries: int = 0  # calls that failed and were sent again

    @property
    def acknowledged(self) -> int:
        return len(self.completions) + len(self.spans) + len(self.rewards) + len(self.finished)


class Traffic(threading.Thread):
    """Runs groups of scripted sessions against `gateway` until `stop()`, `concurrency` groups at a time, each
    worker pausing `pause_s` between its groups."""

    def __init__(self, gateway: str, bootstrap: str, run: str, group_size: int = 2, concurrency: int = 2,
                 pause_s: float = 0.0, admin_token: str | None = None):
        super().__init__(daemon=True, name="fault-traffic")
        self.gateway, self.bootstrap, self.run_id = gateway, bootstrap, run
        self.auth = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}  # the deployment's (`up`)
        self.group_size, self.concurrency, self.pause_s = group_size, concurrency, pause_s
        self.ledger = Ledger()
        self.tasks: dict[str, dict] = {}  # group id -> its Task
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._requests = itertools.count()
        self._seq = itertools.count()

    def stop(self) -> None:
        """Start no new group; the groups in flight run to their end."""
        self._halt.set()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        producer = EventProducer(self.bootstrap, patient=True, log_level=0)  # it waits broker restarts out quietly
        try:
            async with httpx.AsyncClient(timeout=60, headers=self.auth) as client:
                await asyncio.gather(*(self._worker(client, producer) for _ in range(self.concurrency)))
        finally:
            await asyncio.to_thread(producer.close)

    async def _worker(self, client: httpx.AsyncClient, producer: EventProducer) -> None:
        while not self._halt.is_set():
            seq = next(self._seq)
            try:
                await self._group(client, producer, seq)
                await asyncio.sleep(self.pause_s)
            except Exception as exc:  # a group that could not finish: the test fails on `errors`
                self.errors.append(f"group {seq}: {type(exc).__name__}: {exc}")
                return

    async def _group(self, client: httpx.AsyncClient, producer: EventProducer, seq: int) -> None:
        group_id = f"{self.run_id}-g{seq:03d}"
        task = {"event_id": new_event_id(), "event_time": now_ms(), "task_id": f"task-{seq}", "group_id": group_id,
                "seq": seq, "domain": "qa", "grader": "exact", "group_size": self.group_size, "prompt_json": "{}",
                "metadata": {}}
        await asyncio.to_thread(producer.send_sync, TOPICS.tasks, group_id, task)
        self.tasks[group_id] = task
        await asyncio.gather(*(self._session(client, task, k) for k in range(self.group_size)))
        self.ledger.groups[group_id] = seq

    async def _call(self, client: httpx.AsyncClient, method: str, path: str, body, headers=None,
                    done_if=(200, 201)) -> httpx.Response:
        """Send until the gateway answers a status in `done_if` (`body` may be a function: one body per try);
        a connection error, 5xx or 429 is retried; any other answer fails the session."""
        deadline = time.monotonic() + RETRY_FOR_S
        first = True
        while True:
            if not first:
                self.ledger.retries += 1
                await asyncio.sleep(0.5)
            first = False
            try:
                answer = await client.request(method, self.gateway + path, headers=headers,
                                              json=body() if callable(body) else body)
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{path}: still failing after {RETRY_FOR_S:.0f}s: {exc!r}") from exc
                continue
            if answer.status_code in done_if:
                return answer
            if answer.status_code < 500 and answer.status_code != 429 or time.monotonic() > deadline:
                raise AssertionError(f"{path}: {answer.status_code} {answer.text[:300]}")

    async def _session(self, client: httpx.AsyncClient, task: dict, k: int) -> None:
        sid = f"{task['group_id']}-s{k}"
        # a caller-chosen id: a retried open whose first answer was lost is the same session (409 from a gateway
        # that holds it)
        await self._call(client, "POST", "/v1/sessions", {"task_id": task["task_id"], "group_id": task["group_id"],
                                                          "session_id": sid}, done_if=(201, 409))
        self.ledger.opened[sid] = {"session_id": sid, "group_id": task["group_id"], "task_id": task["task_id"]}
        messages: list[dict] = []
        asked: list[dict] = []  # the last try's question

        def chat_body():
            asked[:] = [{"role": "user", "content": f"req-{next(self._requests)}: what is {k} + {len(messages)}?"}]
            return {"model": "tiny", "max_tokens": 6, "temperature": 1.0, "messages": messages + asked}

        for turn in range(2):
            answer = await self._call(client, "POST", f"/s/{sid}/v1/chat/completions", chat_body)
            self.ledger.completions[asked[0]["content"].split(":")[0]] = sid
            messages += [*asked, {"role": "assistant",
                                  "content": answer.json()["choices"][0]["message"]["content"] or ""}]
            if turn == 0:
                start = now_ms()
                span = {"tool_call_id": f"{sid}-calc", "name": "calculator", "arguments": {"expression": "2+3"},
                        "status": "ok" if k % 2 == 0 else "error", "result": "5", "start_ms": start,
                        "end_ms": start + 3}
                recorded = await self._call(client, "POST", f"/v1/sessions/{sid}/spans", {"spans": [span]})
                self.ledger.spans.update((event_id, sid) for event_id in recorded.json()["event_ids"])
        outcome = float((task["seq"] + k) % 3) / 2
        recorded = await self._call(client, "POST", f"/v1/sessions/{sid}/reward", {"value": outcome},
                                    headers={"Idempotency-Key": "outcome"})
        self.ledger.rewards.update((event_id, sid) for event_id in recorded.json()["event_ids"])
        self.ledger.outcomes[sid] = outcome
        # a retried finish whose first try was recorded finds the session finished: 409
        await self._call(client, "POST", f"/v1/sessions/{sid}/finish", {"status": "ok"}, done_if=(200, 409))
        self.ledger.finished[sid] = task["group_id"]
