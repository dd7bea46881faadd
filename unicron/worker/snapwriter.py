"""The background half of a ``unicron.State`` commit: one snapshot finishing while training goes on.

``commit()`` does on the caller's thread only what must see the state exactly at the step
boundary (the tree, every tensor that anything but an optimizer step may change); the copy of
parameters and optimizer state, and the marker that declares the snapshot complete, run here,
overlapping the next step's forward and backward. Those tensors change only inside
``optimizer.step()``, and a global optimizer step pre-hook (``fence``) waits for the pending
snapshot before any optimizer steps, so the copy always sees the values of the committed step.

At most one snapshot is in flight per writer: the next ``submit`` waits for the previous one.
A job's exception is kept as a value and handed to the caller by ``take_error`` (the commit
that follows reports it), never raised in the training loop's face.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

Job = Callable[[], None]

_writers: weakref.WeakSet[Writer] = weakref.WeakSet()
_fence_hook: Any = None  # torch RemovableHandle of the optimizer step pre-hook, once registered


class Writer:
    """One daemon thread running snapshot jobs one at a time."""

    def __init__(self, name: str = "unicron-snapshot") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._job: Job | None = None
        self._busy = False  # a job submitted and not finished (read without the lock: a bool)
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        _writers.add(self)

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, job: Job) -> None:
        """Run ``job`` in the background once the previous one is done."""
        self.wait()
        if os.getpid() != self._pid:  # a forked child has no writer thread: run it here
            self._run_one(job)
            return
        with self._cond:
            self._job = job
            self._busy = True
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the job in flight; False if it is still running after ``timeout`` s."""
        if not self._busy or os.getpid() != self._pid:  # a forked child inherits no thread to wait for
            return True
        with self._cond:
            return self._cond.wait_for(lambda: not self._busy, timeout)

    def take_error(self) -> BaseException | None:
        """The exception of the last job that failed since the previous call, if any."""
        with self._lock():
            err, self._error = self._error, None
            return err

    def _run_one(self, job: Job) -> None:
        try:
            job()
        except BaseException as err:  # noqa: BLE001 - a failed snapshot is reported, training goes on
            with self._lock():
                self._error = err

    def _lock(self) -> threading.Condition | contextlib.nullcontext[None]:
        # In a forked child the parent's lock may have been held at the fork, and no other
        # thread of this writer exists: nothing to exclude.
        return self._cond if os.getpid() == self._pid else contextlib.nullcontext()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._job is not None)
                job, self._job = self._job, None
            assert job is not None
            self._run_one(job)
            job = None  # the job holds its State: do not keep it alive until the next one
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def fence(*_: Any) -> None:
    """Wait for every snapshot in flight (an optimizer is about to change what they copy)."""
    for writer in list(_writers):
        writer.wait()


def flush_all(timeout_s: float) -> None:
    """At exit: wait for every snapshot in flight, at most ``timeout_s`` in all; say what was lost."""
    deadline = time.monotonic() + timeout_s
    for writer in list(_writers):
        if not writer.wait(max(0.0, deadline - time.monotonic())):
            print("unicron: exiting with a snapshot still being written; it is lost", file=sys.stderr, flush=True)
        err = writer.take_error()
        if err is not None:
            print(f"unicron: snapshot write failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


def install_fence() -> None:
    """Register ``fence`` as a global optimizer step pre-hook, once per process."""
    global _fence_hook
    if _fence_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _fence_hook = register_optimizer_step_pre_hook(fence)
