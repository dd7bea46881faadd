"""Is this worker's Python running, while no step comes? (the worker's half of the activity evidence)

A rank stuck in a collective, a lock or a sleep sits still: its main thread's innermost frame and
instruction do not change. A rank evaluating, compiling or writing a checkpoint between two
optimizer steps keeps executing Python: that frame keeps changing. Once the worker is overdue
for a step, a daemon thread samples the main thread's top frame every ``PERIOD_S`` and tells the
agent (``moved``) while it keeps changing, so the hang detector counts it as work, not a stall.

A poller (``while not ready: time.sleep(1)``, a data loader waiting on ``queue.get(timeout=5)``)
changes frame only for the microseconds between two waits; a sample rarely lands there, so
``moving`` asks for changes in at least ``MIN_CHANGES`` of the last ``WINDOW`` samples. Costs
nothing while steps flow: sampling starts only at 1.5 x the median recent step interval (at
least ``OVERDUE_S``); before that the thread only compares two clock readings every ``PERIOD_S``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable

PERIOD_S = 0.25
OVERDUE_S = 0.3  # sampling starts this long after the last step boundary
WINDOW = 8  # samples (2 s)
MIN_CHANGES = 2
SEND_EVERY_S = 0.5


class MotionJudge:
    """Pure: feed one frame signature per sample, ask whether the frame is moving."""

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


def main_thread_signature() -> Hashable:
    """The main thread's innermost Python frame: (code object, last instruction)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    return (id(frame.f_code), frame.f_lasti)


class FrameWatch:
    """The sampling thread. ``boundary()`` at every step; ``emit()`` sends ``moved``."""

    def __init__(self, emit: Callable[[], object], *, clock: Callable[[], float] = time.monotonic) -> None:
        self._emit = emit
        self._clock = clock
        self._last_boundary = clock()
        self._judge = MotionJudge()
        self._last_sent = 0.0
        self._intervals: deque[float] = deque(maxlen=9)  # recent step intervals
        self._overdue_s = OVERDUE_S
        self._pid = os.getpid()
        self._thread: threading.Thread | None = None

    def boundary(self) -> None:
        now = self._clock()
        self._intervals.append(now - self._last_boundary)
        # Overdue: well past a usual step, so a healthy step is never sampled.
        self._overdue_s = max(OVERDUE_S, 1.5 * sorted(self._intervals)[len(self._intervals) // 2])
        self._last_boundary = now
        if self._thread is None or self._pid != os.getpid():  # first step, or a forked child that steps
            self._pid = os.getpid()
            try:
                self._thread = threading.Thread(target=self._run, name="unicron-framewatch", daemon=True)
                self._thread.start()
            except RuntimeError:  # no thread to be had (limits, interpreter exit): go without
                self._thread = None

    def sample(self, now: float) -> bool:
        """One sample (the thread's body, callable from tests); returns whether ``moved`` was sent."""
        if now - self._last_boundary < self._overdue_s:
            self._judge.reset()
            return False
        if not self._judge.add(main_thread_signature()) or now - self._last_sent < SEND_EVERY_S:
            return False
        self._last_sent = now
        self._emit()
        return True

    def _run(self) -> None:
        while True:
            time.sleep(PERIOD_S)
            try:
                self.sample(self._clock())
            except Exception:  # evidence is best effort: never disturb the worker
                pass
