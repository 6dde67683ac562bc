"""`forge-stream bench scheduler`: a seeded discrete-event simulation of rollouts feeding the trainer
through the windowed FIFO core (forge_stream.scheduler.window), comparing consumption policies.

Model (DESIGN section 6, issue 6):
- Rollouts: `slots` concurrent slots filled in submission order. Tasks alternate between two domains,
  "reasoning" (lognormal duration, median 1) and "agent" (median 8), both with log-sigma `s`. Each task
  records the policy version published when it starts.
- A slot frees when its rollout ends and is refilled at once with the next task. Finished groups wait in a
  buffer for the trainer; `buffer=None` (the default, the issue's setting) leaves it unbounded, so rollouts
  may run ahead of the trainer without limit. With `buffer=K` a task starts only while fewer than
  `slots + K` groups are started but not consumed (bounded run-ahead, as async RL systems do to bound
  staleness); then the window's staleness bound `staleness_bound(slots + K, W, batch)` holds.
- Trainer: a step takes `step_time` and trains `batch` groups; the version rises by one per step, and
  rollouts go on during the step. It takes a batch only when `batch` groups are available, except the
  final, partial batch once no rollout is left running. The time it spends waiting is idle time.
- Policies: strict FIFO (W=1), windowed FIFO (W = f * slots), greedy (W unbounded), and greedy with an
  AReaL-style staleness bound eta: while the oldest unconsumed group started more than eta versions ago,
  groups are taken only in submission order (W=1). Every group taken out of order is then at most eta
  versions old; a group older than that waits its turn, so with bounded run-ahead (`buffer`) staleness
  stays below eta + staleness_bound(slots + buffer, 1, batch). The trainer can only pick what the rollouts
  left it, so a consumer-side eta cannot cap staleness below the run-ahead depth (AReaL caps it on the
  rollout side, by throttling submissions).

Metrics per policy and workload: throughput (groups per time unit) relative to greedy, drift (mean over
batches of |agent share - 0.5|), mean and max staleness (trainer version minus the group's start version),
and the trainer's idle share of the run.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass

from forge_stream.scheduler.window import WindowedFifo, WindowSpec, staleness_bound

WORKLOADS = {"mild": 0.5, "heavy": 1.0}


@dataclass(frozen=True)
class SimSettings:
    """The simulated cluster; the defaults are the issue's setting."""

    slots: int = 256
    tasks: int = 8192
    batch: int = 32
    step_time: float = 1.0
    reasoning_median: float = 1.0
    agent_median: float = 8.0
    buffer: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class Policy:
    """How the trainer consumes: a window setting, plus an optional AReaL-style staleness bound eta."""

    name: str
    window: WindowSpec
    eta: int | None = None

    def window_fraction(self, slots: int) -> float | None:
        """The window as a fraction of the slots (1.0 for greedy); None for the eta policy's moving window."""
        if self.eta is not None:
            return None
        if self.window.greedy:
            return 1.0
        if self.window.count is not None:
            return self.window.count / slots
        return self.window.fraction


FIFO = Policy("fifo", WindowSpec(count=1))
GREEDY = Policy("greedy", WindowSpec(greedy=True))


def _durations(settings: SimSettings, sigma: float) -> list[float]:
    rng = random.Random(f"forge-stream/bench/scheduler/{settings.seed}/{sigma}")
    medians = (settings.reasoning_median, settings.agent_median)
    return [medians[i % 2] * math.exp(sigma * rng.gauss(0.0, 1.0)) for i in range(settings.tasks)]


def simulate(settings: SimSettings, sigma: float, policy: Policy) -> dict:
    """Run one policy on one workload; deterministic for a given settings.seed."""
    durations = _durations(settings, sigma)
    n, batch = settings.tasks, settings.batch
    window = policy.window.resolve(settings.slots)
    core = WindowedFifo(window)
    start_version = [0] * n
    running: list[tuple[float, int]] = []
    started = finished = consumed = 0
    version, now, busy_until, idle = 0, 0.0, None, 0.0
    batches: list[tuple[float, int, float]] = []
    staleness_max = 0

    def refill() -> None:
        nonlocal started
        cap = math.inf if settings.buffer is None else settings.slots + settings.buffer
        while started < n and started - finished < settings.slots and started - consumed < cap:
            start_version[started] = version
            core.submit(started)
            heapq.heappush(running, (now + durations[started], started))
            started += 1

    def try_take() -> None:
        nonlocal busy_until, consumed, idle, staleness_max
        if policy.eta is not None and core.head is not None:
            core.window = 1 if version - start_version[core.head] > policy.eta else None
        ready = core.available()
        if ready < batch and (running or ready == 0):
            return
        groups = core.take(batch)
        stale = [version - start_version[g] for g in groups]
        agent_share = sum(g % 2 for g in groups) / len(groups)
        batches.append((abs(agent_share - 0.5), len(groups), sum(stale) / len(stale)))
        staleness_max = max(staleness_max, max(stale))
        idle += now - (busy_until if busy_until is not None else 0.0)
        busy_until = now + settings.step_time
        consumed += len(groups)
        refill()

    refill()
    while consumed < n:
        if busy_until is None or busy_until <= now:
            try_take()
        step_end = busy_until if busy_until is not None and busy_until > now else math.inf
        if step_end <= (running[0][0] if running else math.inf):
            now = step_end
            version += 1
            continue
        now, seq = heapq.heappop(running)
        finished += 1
        core.finish(seq)
        refill()

    makespan = busy_until
    held = math.inf if settings.buffer is None else settings.slots + settings.buffer
    bound = staleness_bound(held, window, batch) if not math.isinf(held) else math.inf
    return {
        "policy": policy.name,
        "window": window,
        "window_fraction": policy.window_fraction(settings.slots),
        "eta": policy.eta,
        "throughput": n / makespan,
        "drift": sum(d for d, _, _ in batches) / len(batches),
        "mean_staleness": sum(k * s for _, k, s in batches) / n,
        "max_staleness": staleness_max,
        "staleness_bound": None if math.isinf(bound) else bound,
        "trainer_idle_share": idle / makespan,
        "makespan": makespan,
        "batches": len(batches),
    }


def calibrate_eta(settings: SimSettings, sigma: float, target_max_staleness: int) -> dict:
    """Search eta (seeded sim) for the largest eta whose max staleness is closest to the target."""
    best = None
    for eta in range(0, target_max_staleness + 1):
        result = simulate(settings, sigma, Policy("greedy_eta", WindowSpec(greedy=True), eta=eta))
        gap = abs(result["max_staleness"] - target_max_staleness)
        if best is None or gap <= best[0]:
            best = (gap, result)
    return best[1]


def run(settings: SimSettings | None = None, fractions: tuple[float, ...] = (0.1, 0.3, 0.5),
        eta_reference: float = 0.3) -> dict:
    """Every policy on every workload, plus the issue's targets checked at W = 0.3 * slots."""
    settings = settings or SimSettings()
    results = []
    targets = {}
    for workload, sigma in WORKLOADS.items():
        rows = [simulate(settings, sigma, FIFO)]
        rows += [simulate(settings, sigma, Policy(f"window_{f:g}", WindowSpec(fraction=f))) for f in fractions]
        greedy = simulate(settings, sigma, GREEDY)
        rows.append(greedy)
        reference = next(r for r in rows if r["window_fraction"] == eta_reference)
        areal = calibrate_eta(settings, sigma, reference["max_staleness"])
        rows.append(areal)
        for row in rows:
            row["throughput_vs_greedy"] = row["throughput"] / greedy["throughput"]
            results.append({"workload": workload, "sigma": sigma} | row)
        targets[workload] = {
            "drift_ratio_vs_greedy": reference["drift"] / greedy["drift"] if greedy["drift"] else None,
            "throughput_vs_greedy": reference["throughput_vs_greedy"],
            "drift_at_most_third_of_greedy": reference["drift"] <= greedy["drift"] / 3,
            "throughput_at_least_90pct": reference["throughput_vs_greedy"] >= 0.9,
        }
    return {"benchmark": "scheduler", "settings": asdict(settings), "results": results, "targets": targets}
