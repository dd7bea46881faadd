"""What are the ranks doing while no step comes? The evidence that tells a hang from work.

Three levels, job-wide (the highest level of any rank counts):

- ``IDLE``: no CPU time, no I/O, Python still. A hung collective, a deadlock, a stuck read:
  every rank waits. A hang once it lasts ``max(k x median, floor)``.
- ``BUSY``: CPU time in the worker process itself but Python still and no I/O: one long native
  call, or a spin-wait (a CUDA synchronisation spins by default, so a hung NCCL collective looks
  like this). Also a rank whose main thread waits inside a data loader (``data`` reports,
  ``unicron.worker.liveness``): a slow read is not a peer holding up a collective, and may use
  no CPU at all. A hang only after the longer ``max(busy_k x median, busy_floor)``.
- ``WORKING``: some rank's Python keeps moving (``unicron.worker.liveness``: an evaluation, a
  compilation), its process tree reads or writes (a checkpoint), its own sockets' data drains
  to a peer (a collective over a slow link: ``unicron.agent.sendqueues``), or its helper processes
  compute (data loader workers, a ``multiprocessing.Pool``, compile workers) while the worker
  waits for them. That is progress: the hang clock restarts from it. A wait in a collective
  keeps no helper computing: a data loader stops once its prefetch queue is full.

Pure: counters, ``moved`` reports and times are passed in; the agent samples the counters with
psutil (``unicron.agent.usage``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass


class Activity(enum.IntEnum):
    IDLE = 0
    BUSY = 1
    WORKING = 2

    @classmethod
    def parse(cls, name: object) -> Activity:
        """From the wire (``"idle"``, ``"busy"``, ``"working"``); anything else is IDLE."""
        try:
            return cls[str(name).upper()]
        except KeyError:
            return cls.IDLE


@dataclass(frozen=True)
class Usage:
    """Cumulative counters of one rank's process tree (the worker and its descendants)."""

    ts: float
    cpu_s: float  # user + system time, reaped children included
    io_bytes: int  # bytes read + written through read()/write()-like calls (files, pipes)
    helper_cpu_s: float = 0.0  # the part of cpu_s spent by the worker's descendants
    # A thread of the tree was in uninterruptible sleep when sampled: waiting on storage (an
    # fsync's writeback, a throttled or network disk), which moves no counter above. A peer in
    # a collective waits interruptibly (gloo, NCCL's host threads), so this is never a hang's wait.
    storage_wait: bool = False
    # Bytes the worker's own TCP send queues drained (``unicron.agent.sendqueues``): a
    # collective's data leaving over a slow link after its write was counted, all at once.
    net_drained: int = 0
    # Seconds the tree's threads were runnable but waited for a CPU (``schedstat``'s run delay),
    # and the descendants' part of it. On an oversubscribed host a computing rank receives a
    # fraction of a core but wants a whole one: what it wants is what tells it from a waiting
    # one (a wait in a collective sleeps, and is never on a run queue).
    runq_s: float = 0.0
    helper_runq_s: float = 0.0
    # A thread of the worker (of its descendants) was runnable (R) when sampled. Run-queue
    # wait counts only when so at both ends of the window: a computing thread always is, while
    # a waiting rank's threads sleep, however long each of their brief wake-ups waited for a CPU.
    runnable: bool = False
    helper_runnable: bool = False
    # The worker's main output (stdout or stderr) was blocked writing into a full pipe or a
    # stopped terminal when sampled: a console reader that is slow or paused (``| less``,
    # Ctrl-S, ``| tee`` over a slow link). The job waits for its reader, as under torchrun.
    output_wait: bool = False


@dataclass(frozen=True)
class BusyRule:
    """Rates that make a rank BUSY (CPU) or WORKING (I/O), measured over ``window_s``.

    0.2 of a core is far above what an idle worker burns (a ZeroMQ I/O thread, a watchdog
    waking up) and far below a single thread computing or spin-waiting (1.0); CPU counts as
    received plus waited for on a run queue, so a host with ten busy processes per core, where
    a computing rank receives 0.1 of a core, still shows it computing. 64 KiB/s of I/O
    catches a checkpoint being written or a dataset being read with little CPU, and a
    collective's traffic through a slow link: gloo sends with ``writev``, which the kernel
    counts (its receives are not counted, but activity is job-wide, and every transfer has a
    sender). A rank in a hung collective moves no bytes at all, and a logging thread far less
    (64 KiB/s would be over 300 lines of 200 characters a second). Bytes drained from the
    worker's TCP send queues need far less (1 KiB/s): only data on its way to a peer drains, so
    even a link degraded to a few kbit/s is a collective at work; a hung one drains nothing.
    """

    cpu_cores: float = 0.2
    io_bytes_per_s: float = 64.0 * 1024.0
    net_bytes_per_s: float = 1024.0
    window_s: float = 1.0
    period_s: float = 0.25

    def __post_init__(self) -> None:
        if min(self.cpu_cores, self.io_bytes_per_s, self.net_bytes_per_s, self.period_s) <= 0:
            raise ValueError("cpu_cores, io_bytes_per_s, net_bytes_per_s and period_s must be > 0")
        if self.window_s < self.period_s:
            raise ValueError("window_s must be at least period_s")


def level_between(before: Usage, after: Usage, rule: BusyRule) -> Activity:
    """What the tree did between two samples of it (counters that went back count as 0: a
    process of the tree exited and its time went to a parent outside it)."""
    dt = after.ts - before.ts
    if dt <= 0:
        return Activity.IDLE
    if after.storage_wait and before.storage_wait:  # waited on storage the whole window: I/O work
        return Activity.WORKING
    if after.output_wait and before.output_wait:  # ... or on whoever reads its output
        return Activity.WORKING
    if max(0, after.io_bytes - before.io_bytes) / dt >= rule.io_bytes_per_s:
        return Activity.WORKING
    if max(0, after.net_drained - before.net_drained) / dt >= rule.net_bytes_per_s:
        return Activity.WORKING  # its data is on its way to a peer: a slow collective
    helpers = max(0.0, after.helper_cpu_s - before.helper_cpu_s)
    if before.helper_runnable and after.helper_runnable:
        helpers += max(0.0, after.helper_runq_s - before.helper_runq_s)
    if helpers / dt >= rule.cpu_cores:
        return Activity.WORKING  # its helpers compute (or want to): the worker waits for their output
    wanted = max(0.0, after.cpu_s - before.cpu_s)
    if before.runnable and after.runnable:
        wanted += max(0.0, (after.runq_s - after.helper_runq_s) - (before.runq_s - before.helper_runq_s))
    if wanted / dt >= rule.cpu_cores:
        return Activity.BUSY  # it computes, or would if the host gave it a core
    return Activity.IDLE


class ActivityTracker:
    """Samples of every local rank's usage and ``moved`` reports, while the job is overdue.

    ``level(now)`` is None while there is no evidence yet (no rank with two samples at least a
    period apart, and no recent ``moved``); the detector then keeps the idle threshold, which is
    never reached that early.
    """

    def __init__(self, rule: BusyRule | None = None) -> None:
        self.rule = rule or BusyRule()
        self._samples: dict[int, deque[Usage]] = {}
        self._moved: dict[int, float] = {}
        self._data: dict[int, float] = {}
        self._last_ts: float | None = None

    def reset(self) -> None:
        """Forget all evidence (a step completed, or a new attempt began)."""
        self._samples.clear()
        self._moved.clear()
        self._data.clear()
        self._last_ts = None

    def due(self, now: float) -> bool:
        return self._last_ts is None or now - self._last_ts >= self.rule.period_s

    def moved(self, rank: int, ts: float) -> None:
        """The rank's worker saw its Python moving at ``ts``."""
        self._moved[rank] = max(ts, self._moved.get(rank, ts))

    def waits_for_data(self, rank: int, ts: float) -> None:
        """The rank's main thread waited inside a data loader at ``ts``."""
        self._data[rank] = max(ts, self._data.get(rank, ts))

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

    def levels(self, now: float) -> dict[int, Activity]:
        """Each judged rank's level over the last window."""
        out: dict[int, Activity] = {}
        for rank, samples in self._samples.items():
            if len(samples) >= 2 and samples[-1].ts - samples[0].ts >= self.rule.period_s * 0.9:
                out[rank] = level_between(samples[0], samples[-1], self.rule)
        for rank, ts in self._data.items():
            if now - ts <= self.rule.window_s:
                out[rank] = max(out.get(rank, Activity.IDLE), Activity.BUSY)
        for rank, ts in self._moved.items():
            if now - ts <= self.rule.window_s:
                out[rank] = Activity.WORKING
        return out

    def level(self, now: float) -> Activity | None:
        levels = self.levels(now)
        return max(levels.values()) if levels else None
