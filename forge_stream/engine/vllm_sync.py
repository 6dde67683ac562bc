"""Push each new policy version of one training run into running `vllm serve` workers.

`forge-stream engine vllm-sync` follows `forge.policy` (key = training run, `newest()` from policy_watch) and, for
each newer PolicyVersion, updates every configured worker in order with this plan of HTTP calls (`update_plan`,
pure; `VllmWorkerClient` runs it with httpx):

    GET  /is_sleeping                          -> {"is_sleeping": false}, else the worker is skipped this try
    POST /pause?mode=wait                      in-flight requests finish on the old weights
    POST /collective_rpc {"method": "update_config", "args": [{"model_config": {"model": DIR}}]}
    POST /collective_rpc {"method": "reload_weights"}      every worker process reloads from DIR in place
    POST /update_weight_version {"new_version": "V"}       `GET /weight_info` then reports V
    POST /reset_prefix_cache?reset_external=true           drops the GPU prefix cache and the LMCache tier
    POST /resume

The checkpoint directory is the PolicyVersion's `checkpoint_uri`, read by the workers on a shared filesystem.
A failed try is retried with exponential backoff; a try that fails after the pause resumes the worker before
the next one, so a worker that never succeeds keeps serving the old version (the gateway records the served
`policy_version` per completion anyway) and is reported in the `SyncReport`.

What the calls are, and why this path (pinned: vllm==0.32.0, served with VLLM_SERVER_DEV_MODE=1):
- vllm-project/vllm `vllm/entrypoints/serve/dev/rlhf/api_router.py`: `/pause` (query `mode` abort|wait|keep),
  `/resume`, `/is_paused`, `/init_weight_transfer_engine` {"init_info"}, `/start_weight_update`,
  `/update_weights` {"update_info"}, `/finish_weight_update` {"weight_version"}, `/update_weight_version`
  {"new_version"}, `/weight_info` -> {"weight_version"}.
- The released weight-transfer backends (`vllm/distributed/weight_transfer/factory.py`: nccl, ipc, sparse_nccl)
  move tensors from a trainer process that holds them on a GPU; none reads a checkpoint directory. The
  shared-disk backend that would (`vllm/distributed/weight_transfer/disk_engine.py`, update_info {"path"}) is
  vllm PR #52152, open and unreleased. So the weights go through the dev `/collective_rpc` route
  (`vllm/entrypoints/serve/dev/rpc/api_router.py`: body {"method", "args", "kwargs", "timeout"}) calling the
  GPU worker's `update_config` then `reload_weights` (the model runner reloads from `model_config.model`),
  and the version is set with `/update_weight_version` instead of `finish_weight_update`.
- `/is_sleeping`, `/sleep`, `/wake_up`: `vllm/entrypoints/serve/dev/sleep/api_router.py`; reloading a
  sleeping engine crashes it (vllm #57853), hence the check first.
- `/reset_prefix_cache?reset_external=true` (`vllm/entrypoints/serve/dev/cache/api_router.py`) also resets
  the connector-managed cache, i.e. LMCache, so no KV computed by the old weights is reused.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from forge_stream.engine.policy_watch import newest
from forge_stream.kafka.follow import Follower
from forge_stream.topics import TOPICS

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Call:
    """One HTTP request of an update plan; `expect` is the JSON body the step requires, if any."""

    method: str
    path: str
    params: dict = field(default_factory=dict)
    body: dict | None = None
    expect: dict | None = None


@dataclass(frozen=True)
class SyncSettings:
    workers: tuple[str, ...]
    run: str = "default"
    attempts: int = 3
    backoff_s: float = 0.5
    timeout_s: float = 600.0
    poll_ms: int = 500
    initial_version: int = 0


@dataclass
class SyncReport:
    version: int
    checkpoint: str
    updated: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


class WorkerError(RuntimeError):
    """A step of the plan failed on one worker."""


def update_plan(checkpoint_dir: str, version: int) -> list[Call]:
    """The HTTP calls that move one worker to `version`, loaded from `checkpoint_dir`."""
    return [
        Call("GET", "/is_sleeping", expect={"is_sleeping": False}),
        Call("POST", "/pause", params={"mode": "wait"}),
        Call("POST", "/collective_rpc",
             body={"method": "update_config", "args": [{"model_config": {"model": checkpoint_dir}}]}),
        Call("POST", "/collective_rpc", body={"method": "reload_weights"}),
        Call("POST", "/update_weight_version", body={"new_version": str(version)}),
        Call("POST", "/reset_prefix_cache", params={"reset_external": "true"}),
        Call("POST", "/resume"),
    ]


def backoff_delays(attempts: int, base_s: float) -> list[float]:
    """Seconds to wait before each retry: base, 2 base, 4 base, ... (attempts - 1 of them)."""
    return [base_s * 2 ** i for i in range(attempts - 1)]


class VllmWorkerClient:
    """Runs update plans against one worker over HTTP."""

    def __init__(self, url: str, client: httpx.AsyncClient):
        self.url = url.rstrip("/")
        self.client = client

    async def call(self, step: Call) -> None:
        response = await self.client.request(step.method, self.url + step.path, params=step.params or None,
                                             json=step.body)
        if response.status_code != 200:
            raise WorkerError(f"{step.method} {step.path}: HTTP {response.status_code} {response.text[:200]}")
        if step.expect is not None:
            got = response.json()
            if any(got.get(k) != v for k, v in step.expect.items()):
                raise WorkerError(f"{step.method} {step.path}: expected {step.expect}, got {got}")

    async def apply(self, plan: list[Call]) -> None:
        """Run `plan`; if it fails after pausing, resume the worker (best effort) and re-raise."""
        paused = False
        try:
            for step in plan:
                await self.call(step)
                paused = paused or step.path == "/pause"
        except (WorkerError, httpx.HTTPError):
            if paused:
                try:
                    await self.call(Call("POST", "/resume"))
                except (WorkerError, httpx.HTTPError) as exc:
                    log.warning("%s: resume after a failed update failed too: %s", self.url, exc)
            raise


async def update_worker(worker: VllmWorkerClient, plan: list[Call], settings: SyncSettings) -> None:
    """Apply `plan`, retrying the whole plan with backoff; raises the last error."""
    delays = backoff_delays(settings.attempts, settings.backoff_s)
    for attempt in range(settings.attempts):
        try:
            await worker.apply(plan)
            return
        except (WorkerError, httpx.HTTPError) as exc:
            if attempt == settings.attempts - 1:
                raise
            log.warning("%s: update try %d failed (%s); retrying in %.1fs", worker.url, attempt + 1, exc,
                        delays[attempt])
            await asyncio.sleep(delays[attempt])


async def sync_version(workers: list[VllmWorkerClient], target: dict, settings: SyncSettings) -> SyncReport:
    """Move every worker, one after the other, to the PolicyVersion `target`."""
    report = SyncReport(target["version"], target["checkpoint_uri"])
    plan = update_plan(target["checkpoint_uri"], target["version"])
    for worker in workers:
        try:
            await update_worker(worker, plan, settings)
            report.updated.append(worker.url)
        except (WorkerError, httpx.HTTPError) as exc:
            report.failed[worker.url] = str(exc)
            log.error("%s: keeps serving its old weights; version %s failed: %s", worker.url,
                      target["version"], exc)
    log.info("policy version %s: updated %s, failed %s", report.version, report.updated, list(report.failed))
    return report


async def follow_policy(bootstrap: str, settings: SyncSettings, on_report=None) -> None:
    """Run until cancelled (waiting for Kafka first if it does not answer). The history up to the end offsets at
    start is read first and only its newest version is applied; afterwards each batch's newest version is.
    `on_report(SyncReport)` sees each sync."""
    current, current_path = settings.initial_version, None
    async with Follower(bootstrap, TOPICS.policy, settings.run, settings.poll_ms) as policy, \
            httpx.AsyncClient(timeout=settings.timeout_s) as client:
        workers = [VllmWorkerClient(url, client) for url in settings.workers]
        pending = await policy.backlog()
        while True:
            target = newest(pending, current, current_path)
            if target is not None:
                report = await sync_version(workers, target, settings)
                current, current_path = target["version"], target["checkpoint_uri"]
                if on_report is not None:
                    on_report(report)
            pending = await policy.next()
