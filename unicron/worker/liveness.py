"""Is this worker's Python running, while no step comes? (the worker's half of the activity evidence)

A rank stuck in a collective, a lock or a sleep sits still: its main thread's innermost frame
stays the same call at the same instruction. A rank evaluating, compiling or writing a
checkpoint between two optimizer steps keeps executing Python: calls come and go. Once the
worker is overdue for a step, a daemon thread samples the main thread's innermost frame and
tells the agent (``moved``) while it keeps changing, so the hang detector counts it as work, not
a stall.

A sample is the frame *object* and its instruction, compared by identity: samples are not
random (the sampler gets the GIL when the main thread lets it go, in an evaluation loop mostly
at the call into a torch op), so comparing only code and instruction saw ``Linear, Tanh,
Linear`` as one frame (the two Linear calls look alike: sometimes 20 samples in a row) and took
an evaluation for a native spin. A new call is a new frame object, and holding the last sampled
frame (at most ``SAMPLE_S`` longer, only while overdue) keeps its address from being reused.

Polling is not motion. ``while not ready: time.sleep(1)`` stays in one frame; a loop of
``queue.get(timeout=5)`` makes a new call only every 5 s, so ``moving`` asks for changes in at
least ``MIN_CHANGES`` of the last ``WINDOW`` samples. A poller with short timeouts changes calls
often but burns almost no CPU (a 10 ms timeout: well under 1% of a core), so motion also needs
the main thread to have used at least ``MIN_CPU`` of a core over the window (its own CPU clock:
other threads do not count). An evaluation that mostly waits for its GPU in a *blocking*
synchronisation (not CUDA's default spin) can fall under it; it then counts as idle.
Holding a frame keeps its locals (an activation) alive up to ``SAMPLE_S`` longer; ``stop()`` at
the script's end drops it.

A loop of native calls (one big op per evaluation batch) shows the sampler the same frame at
the same call every time, as one long native call would. It is told apart by the main thread
coming back to the interpreter between samples (``unicron.worker.mainreturns``): with the main
thread computing at least ``MIN_CPU_THREAD`` of a core, that is motion too, so only a single
native call longer than the busy threshold can be one.

Work can also run in other Python threads while the main thread waits for it (an evaluation
on a thread pool, a prefetching thread). Each such thread is judged the same way, on its own
frames and its own CPU clock (``/proc/self/task/TID/schedstat``), with a higher bar
(``MIN_CPU_THREAD``): a monitoring thread that wakes every few milliseconds makes new calls but
barely computes, and must not keep a hung rank looking busy with work. A pool task that is one
long native op changes no frame for seconds: while the main thread is blocked on another thread
(its innermost frame in ``threading``: a future, ``executor.map``, a join) and a thread of its
own computes at that bar, that is work too. unicron's own threads (named ``unicron-...``) never count.

A rank whose main thread waits inside a ``torch.utils.data`` loader (for its workers' next
batch: a slow network or NFS read, a ``worker_init_fn`` opening a remote dataset; or a
``num_workers=0`` dataset read), or waits outside ``torch.distributed`` while a thread of its
own is inside one (a prefetching thread), is not stuck on a peer, and a data loader has its own
``timeout``. While overdue such a wait is reported (``data``, at most every ``SEND_EVERY_S``) and
the agent holds the job to its longer busy threshold (``unicron.detect.activity``): a hang then
needs the whole job still for ``max(busy k x median, busy floor)``, not the idle floor.

Costs nothing while steps flow: sampling starts only at 1.5 x the median recent step interval
(at least ``OVERDUE_S``); before that the thread only compares two clock readings every
``PERIOD_S``. Once overdue it samples every ``SAMPLE_S``. The thread starts with the script
(``begin``) where the agent says from when it judges the start-up (``UNICRON_WATCH_START``:
0.4 x the first-step allowance), and samples from then until the first step; else at the first
step.

What one look at the threads' frames says (a sample, a wait for data, for another thread, a
debugger) is in ``unicron.worker.threadframes``; this module judges it over time.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from types import ModuleType
from typing import Any

from unicron.worker.mainreturns import MainThreadReturns
from unicron.worker.threadframes import (
    FrameSample,
    in_debugger,
    main_thread_signature,
    user_threads,
    waits_for_data,
    waits_for_threads,
)

PERIOD_S = 0.25  # while steps flow: only a clock comparison
SAMPLE_S = 0.05  # while overdue: one sample
OVERDUE_S = 0.3  # sampling starts this long after the last step boundary
BEFORE_FIRST_STEP_S = 2.0  # ... or after ``begin()``: a warm restart steps well within it
WINDOW = 20  # samples (1 s at SAMPLE_S)
MIN_CHANGES = 2
MIN_CPU = 0.02  # cores used by the main thread over the window, for motion to count
SEND_EVERY_S = 0.5
ALIVE_S = 1.0  # past its end (``tail()``), the thread says ``alive`` this often: unicron.agent.frozen
MIN_CPU_THREAD = 0.2  # cores a thread other than the main one must use for its motion to count

_batches = 0  # batches the process's data loader iterators yielded (``count_batch``, from hooks)


def count_batch() -> None:
    """A data loader iterator yielded a batch (its ``__next__`` is wrapped by ``hooks``)."""
    global _batches
    _batches += 1


def count_batches_of(dataloader_module: ModuleType) -> None:
    """Wrap the data loader iterators' ``__next__`` (once) to count the batches they yield
    (``torch.utils.data.dataloader``, as the worker's hooks see it imported)."""
    base = getattr(dataloader_module, "_BaseDataLoaderIter", None)
    original = getattr(base, "__next__", None)
    if base is None or original is None or getattr(original, "_unicron", False):
        return

    @functools.wraps(original)
    def __next__(self: Any) -> Any:
        batch = original(self)
        count_batch()
        return batch

    __next__._unicron = True  # type: ignore[attr-defined]
    base.__next__ = __next__


class MotionJudge:
    """Pure: feed one sample per tick, ask whether the frame is moving."""

    def __init__(self, window: int = WINDOW, min_changes: int = MIN_CHANGES) -> None:
        self._changes: deque[bool] = deque(maxlen=window)
        self._last: Hashable | None = None
        self.min_changes = min_changes

    def reset(self) -> None:
        self._changes.clear()
        self._last = None

    def add(self, signature: Hashable) -> bool:
        """Record a sample; returns whether the frame is moving now."""
        if self._last is not None:
            self._changes.append(signature != self._last)
        self._last = signature
        return sum(self._changes) >= self.min_changes


def main_thread_cpu() -> float | None:
    """CPU seconds the main thread has used (its own clock), None where unavailable."""
    try:
        ident = threading.main_thread().ident
        return None if ident is None else time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):  # not Linux / no such clock
        return None


def thread_cpu(native_id: int) -> float | None:
    """CPU seconds a thread of this process has used; None once it is gone (a file, never a
    clock id of a thread that may have exited)."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def _median(values: deque[float]) -> float:
    return sorted(values)[len(values) // 2]


def _rate(samples: deque[tuple[float, float]]) -> float:
    if len(samples) < 2:
        return 0.0
    (t0, c0), (t1, c1) = samples[0], samples[-1]
    return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


class OtherThreads:
    """Python threads other than the main one and the caller's, judged as the main thread is,
    each on its own frames and CPU (at least ``MIN_CPU_THREAD``)."""

    def __init__(self, cpu: Callable[[int], float | None] = thread_cpu) -> None:
        self._cpu = cpu
        self._seen: dict[int, tuple[MotionJudge, deque[tuple[float, float]]]] = {}
        self.computing = False  # at the last sample: one of them used MIN_CPU_THREAD, moving or not

    def reset(self) -> None:
        self._seen.clear()  # drops the frames the judges hold
        self.computing = False

    def moving(self, now: float) -> bool:
        """One sample of every such thread; whether any of them is moving and computing."""
        frames = sys._current_frames()
        threads = {t.ident: t.native_id for t in user_threads() if t.ident is not None and t.native_id is not None}
        for ident in [i for i in self._seen if i not in threads]:
            del self._seen[ident]
        moving = self.computing = False
        for ident, native_id in threads.items():
            frame = frames.get(ident)
            if frame is None:
                continue
            judge, cpu = self._seen.setdefault(ident, (MotionJudge(), deque(maxlen=WINDOW + 1)))
            changed = judge.add(FrameSample(frame, frame.f_lasti))  # every thread, every sample
            used = self._cpu(native_id)
            if used is not None:
                cpu.append((now, used))
            computes = _rate(cpu) >= MIN_CPU_THREAD
            self.computing = self.computing or computes
            moving = moving or (changed and computes)
        return moving


class FrameWatch:
    """The sampling thread. ``boundary()`` at every step; ``emit()`` sends ``moved``,
    ``emit_data()`` says the main thread waits for a data loader."""

    def __init__(self, emit: Callable[[], object], *, emit_data: Callable[[], object] | None = None,
                 emit_alive: Callable[[], object] | None = None, clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float | None] = main_thread_cpu,
                 others: OtherThreads | None = None, returns: MainThreadReturns | None = None) -> None:
        self._emit = emit
        self._returns = returns if returns is not None else MainThreadReturns()
        self._batches_seen = _batches
        self._emit_data = emit_data
        self._emit_alive = emit_alive
        self._tail = False  # past the script's last collective or its end: say ``alive``
        self._last_alive = 0.0
        self._last_data_sent = 0.0
        self._others = others if others is not None else OtherThreads()
        self._clock = clock
        self._cpu = cpu
        self._cpu_samples: deque[tuple[float, float]] = deque(maxlen=WINDOW + 1)
        self._last_boundary = clock()
        self._judge = MotionJudge()
        self._last_sent = 0.0
        self._intervals: deque[float] = deque(maxlen=9)  # recent step intervals
        self._history: deque[float] = deque(maxlen=50)  # the window of the agent's step median
        self._idle: tuple[float, float] | None = None  # the agent's idle threshold: (k, floor)
        self._overdue_s = OVERDUE_S
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def begin(self, overdue_s: float = BEFORE_FIRST_STEP_S) -> None:
        """Watch from now, before the first step: sampling starts ``overdue_s`` from now, when the
        agent starts judging the start-up (``UNICRON_WATCH_START``)."""
        self._last_boundary = self._clock()
        self._overdue_s = max(OVERDUE_S, overdue_s)
        self._start_thread()

    def idle_threshold(self, k: float, floor_s: float) -> None:
        """The agent calls a still job hung after ``max(k x median step, floor_s)``."""
        self._idle = (k, floor_s)

    def boundary(self) -> None:
        now = self._clock()
        self._intervals.append(now - self._last_boundary)
        self._history.append(now - self._last_boundary)
        # Overdue: well past a usual step, so a healthy step is never sampled. But never later
        # than the agent starts looking (0.4 x its idle threshold, from a median over 50 steps):
        # after a run of slow steps (a storage hiccup) the recent median is long, and a wait
        # for data sampled only then would be reported after the agent called it idle.
        usual = 1.5 * _median(self._intervals)
        if self._idle is not None:
            k, floor_s = self._idle
            usual = min(usual, 0.4 * max(k * _median(self._history), floor_s))
        self._overdue_s = max(OVERDUE_S, usual)
        self._last_boundary = now
        self._start_thread()

    def _start_thread(self) -> None:
        if self._thread is None or self._pid != os.getpid():  # first step, or a forked child that steps
            self._pid = os.getpid()
            try:
                self._thread = threading.Thread(target=self._run, name="unicron-framewatch", daemon=True)
                self._thread.start()
            except RuntimeError:  # no thread to be had (limits, interpreter exit): go without
                self._thread = None

    def tail(self) -> None:
        """Past its last collective (its default group destroyed) or its end: from now the thread
        says ``alive`` every ``ALIVE_S`` while the interpreter lock lets it run. The first is said
        here, once the thread runs: the agent judges only a rank that has one (a rank may freeze
        before its thread runs once; one with no thread to be had must not look frozen)."""
        self._tail = True
        self._start_thread()
        if self._emit_alive is not None and self._thread is not None and self._thread.is_alive():
            self._last_alive = self._clock()
            self._emit_alive()

    def stop(self) -> None:
        """No more samples (the script is ending): drop the frame the judge holds."""
        self._stopped = True
        self._judge.reset()
        self._others.reset()

    def sample(self, now: float) -> bool:
        """One sample (the thread's body, callable from tests); returns whether ``moved`` was sent."""
        if self._stopped or not self.overdue(now):
            self._judge.reset()  # drops the frame it holds
            self._others.reset()
            self._cpu_samples.clear()
            self._returns.reset()
            self._batches_seen = _batches
            self._last_data_sent = 0.0  # a new wait is reported at once
            return False
        signature = main_thread_signature()
        moving = self._judge.add(signature)
        returned = self._returns.returned()
        cpu = self._cpu()
        if cpu is not None:
            self._cpu_samples.append((now, cpu))
        # Without the thread's CPU clock the frames alone decide.
        computing = cpu is None or self._computing()
        # Native calls one after another, computing (mainreturns): each ends, so none is the
        # long call the busy threshold waits for. The higher bar keeps out a wait that polls.
        looping = returned and cpu is not None and _rate(self._cpu_samples) >= MIN_CPU_THREAD
        # Batches keep coming (an evaluation over a loader whose workers wait on slow storage:
        # the main thread waits in the loader, at little CPU, between short forwards), or a
        # person holds the rank in a debugger: progress either way, not a stall.
        batches = _batches
        arrived, self._batches_seen = batches != self._batches_seen, batches
        others = self._others.moving(now)
        pooled = self._others.computing and waits_for_threads(signature)
        if not (moving and computing or looping or arrived or others or pooled or in_debugger(signature)):
            if self._emit_data is not None and now - self._last_data_sent >= SEND_EVERY_S \
                    and waits_for_data(signature):
                self._last_data_sent = now
                self._emit_data()
            return False
        if now - self._last_sent < SEND_EVERY_S:
            return False
        self._last_sent = now
        self._emit()
        return True

    def _computing(self) -> bool:
        """The main thread used at least ``MIN_CPU`` of a core over the window."""
        return _rate(self._cpu_samples) >= MIN_CPU

    def overdue(self, now: float) -> bool:
        return now - self._last_boundary >= self._overdue_s

    def _run(self) -> None:
        while True:
            time.sleep(SAMPLE_S if self.overdue(self._clock()) else PERIOD_S)
            try:
                now = self._clock()
                self.sample(now)
                if self._tail and self._emit_alive is not None and now - self._last_alive >= ALIVE_S:
                    self._last_alive = now
                    self._emit_alive()
            except Exception:  # evidence is best effort: never disturb the worker
                pass
