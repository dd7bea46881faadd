"""Is any rank doing work? The evidence that separates a hang from a long phase between steps.

A hung collective, a deadlock or a stuck read leaves every rank of the job idle: no CPU time,
no I/O. An evaluation, a checkpoint write or a CUDA spin-wait keeps at least one rank busy.
The hang detector (``unicron.detect.hang``) holds an idle job to a short threshold and a busy
one to a longer one. Pure: counters and times are passed in; the agent samples them with psutil
(``unicron.agent.usage``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Usage:
    """Cumulative counters of one rank's process tree (the worker and its descendants)."""

    ts: float
    cpu_s: float  # user + system time, reaped children included
    io_bytes: int  # bytes read + written through read()/write()-like calls (files, pipes)


@dataclass(frozen=True)
class BusyRule:
    """Rates above which a rank counts as busy, measured over ``window_s``.

    0.2 of a core is far above what an idle worker burns (a ZeroMQ I/O thread, a watchdog
    waking up) and far below a single thread computing or spin-waiting (1.0). 1 MiB/s of I/O
    catches a checkpoint being written or a dataset being read with little CPU.
    """

    cpu_cores: float = 0.2
    io_bytes_per_s: float = 1024.0 * 1024.0
    window_s: float = 1.0
    period_s: float = 0.25

    def __post_init__(self) -> None:
        if self.cpu_cores <= 0 or self.io_bytes_per_s <= 0 or self.period_s <= 0:
            raise ValueError("cpu_cores, io_bytes_per_s and period_s must be > 0")
        if self.window_s < self.period_s:
            raise ValueError("window_s must be at least period_s")


def busy_between(before: Usage, after: Usage, rule: BusyRule) -> bool:
    """Whether the tree was busy between two samples of it (counters that went back count as 0:
    a process of the tree exited and its time went to a parent outside it)."""
    dt = after.ts - before.ts
    if dt <= 0:
        return False
    cpu = max(0.0, after.cpu_s - before.cpu_s) / dt
    io = max(0, after.io_bytes - before.io_bytes) / dt
    return cpu >= rule.cpu_cores or io >= rule.io_bytes_per_s


class ActivityTracker:
    """Samples of every local rank's usage, taken while the job is overdue for a step.

    ``busy()`` is None until two samples at least ``period_s`` apart exist: no evidence either
    way (the detector then keeps the idle threshold, which is never reached that early).
    """

    def __init__(self, rule: BusyRule | None = None) -> None:
        self.rule = rule or BusyRule()
        self._samples: dict[int, deque[Usage]] = {}
        self._last_ts: float | None = None

    def reset(self) -> None:
        """Forget all samples (a step completed, or a new attempt began)."""
        self._samples.clear()
        self._last_ts = None

    def due(self, now: float) -> bool:
        return self._last_ts is None or now - self._last_ts >= self.rule.period_s

    def add(self, now: float, usage: Mapping[int, Usage | None]) -> None:
        """One sample of each rank (None: the rank's process is gone; its samples are dropped)."""
        self._last_ts = now
        for rank, u in usage.items():
            if u is None:
                self._samples.pop(rank, None)
                continue
            samples = self._samples.setdefault(rank, deque())
            samples.append(u)
            # Keep the newest sample at least window_s older than the current one, and no older.
            while len(samples) > 2 and samples[-1].ts - samples[1].ts >= self.rule.window_s:
                samples.popleft()

    def busy_ranks(self) -> list[int] | None:
        """Ranks busy over the last window; None while no rank has two samples yet."""
        found: list[int] = []
        judged = False
        for rank, samples in sorted(self._samples.items()):
            if len(samples) < 2 or samples[-1].ts - samples[0].ts < self.rule.period_s * 0.9:
                continue
            judged = True
            if busy_between(samples[0], samples[-1], self.rule):
                found.append(rank)
        return found if judged else None

    def busy(self) -> bool | None:
        ranks = self.busy_ranks()
        return None if ranks is None else bool(ranks)
