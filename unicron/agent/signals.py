"""Signals and reaping for the launcher process itself: forward SIGTERM/SIGINT/SIGHUP/SIGQUIT
to the workers and become the subreaper of their orphaned descendants."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from types import FrameType, TracebackType

from unicron.agent.procs import WorkerProcess
from unicron.agent.terminate import TerminationReport, terminate_all
from unicron.errors import Interrupted

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

def set_child_subreaper(enabled: bool = True) -> bool:
    """Make orphaned descendants re-parent to this process (Linux), so they can be found and reaped.

    Call from the agent's main; returns False where unsupported.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, int(enabled), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def is_child_subreaper() -> bool:
    """Whether orphaned descendants of this process come back to it (``set_child_subreaper``)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        if int(libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)) != 0:
            return False
        return flag.value != 0
    except (OSError, AttributeError):
        return False


# A repeat of the first signal this soon after it is the same signal delivered twice, not the
# user's second Ctrl-C: coreutils' timeout sends its signal to the launcher and then to its whole
# process group, and supervisors that kill a process and then its group do the same.
DUPLICATE_S = 0.25

# torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE default.
LAUNCHER_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


# Signals that are the script's business: Slurm's ``--signal=USR1@90`` (Lightning's
# checkpoint-and-requeue) sends them to every process of the step, the workers included. Their
# default action killed the launcher, and with it (PR_SET_PDEATHSIG) the workers, in the middle
# of their handler (acceptance 23B F1). The launcher lets them pass (a handler that does
# nothing: an ignored signal would stay ignored in the workers it starts); ``--signals-to-handle``
# may still make them a stop.
SCRIPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# How long hang verdicts wait after such a signal: the workers' handlers (write a checkpoint,
# ``scontrol requeue``) may hold every rank between two steps, and a handler is no hang.
SCRIPT_SIGNAL_HOLD_S = 30.0


class LauncherSignals:
    """SIGTERM/SIGINT/SIGHUP/SIGQUIT handling for ``unicron run``, installed for a ``with`` block.

    A signal is recorded and wakes the agent loop (``fileno`` is readable: pass it to
    ``wait_any(wake_fds=...)``). The agent then calls ``stop_workers`` (forwards the same signal
    to every worker tree, SIGKILL after the grace period, at once on a second signal, not a
    duplicate delivery of the first: ``DUPLICATE_S``) and exits
    with ``exit_code`` (128 + signum) or ``raise_if_received``.
    """

    def __init__(self, signals: Iterable[int] = LAUNCHER_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[int] = []
        self.escalated = False  # a second signal came: what is left is killed at once
        self._first_at: float | None = None
        self.script_signal_at: float | None = None  # monotonic: the last of SCRIPT_SIGNALS
        self.script_signal_name = ""
        self._previous: dict[int, object] = {}
        self._read_fd: int | None = None
        self._write_fd: int | None = None

    def install(self) -> LauncherSignals:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread")
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        for signum in SCRIPT_SIGNALS:
            if signum not in self.signals:
                self._previous[signum] = signal.signal(signum, self._scripts_business)
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)  # type: ignore[arg-type]
        self._previous.clear()
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._write_fd = None

    def __enter__(self) -> LauncherSignals:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
        elif signum != self.received[0] or now - self._first_at >= DUPLICATE_S:
            self.escalated = True
        self.received.append(signum)
        if self._write_fd is not None:
            try:
                os.write(self._write_fd, b"\0")
            except OSError:
                pass  # pipe full: a wake-up is already pending

    def _scripts_business(self, signum: int, frame: FrameType | None) -> None:
        """The launcher's copy of a signal meant for the workers (``SCRIPT_SIGNALS``): noted only."""
        self.script_signal_at = time.monotonic()
        self.script_signal_name = signal.Signals(signum).name

    def script_hold(self, now: float) -> bool:
        """Whether hang verdicts wait: within ``SCRIPT_SIGNAL_HOLD_S`` of a ``SCRIPT_SIGNALS``."""
        return self.script_signal_at is not None and now - self.script_signal_at < SCRIPT_SIGNAL_HOLD_S

    def fileno(self) -> int:
        if self._read_fd is None:
            raise RuntimeError("LauncherSignals is not installed")
        return self._read_fd

    @property
    def signum(self) -> int | None:
        """The first signal received, or None."""
        return self.received[0] if self.received else None

    @property
    def exit_code(self) -> int | None:
        return None if self.signum is None else 128 + self.signum

    def stop_workers(
        self, workers: Sequence[WorkerProcess], grace_s: float, *, clock: Callable[[], float] = time.monotonic
    ) -> TerminationReport:
        """Forward the received signal (SIGTERM if none) to every worker tree and reap them."""
        sig = self.signum if self.signum is not None else signal.SIGTERM
        return terminate_all(workers, grace_s, sig=sig, clock=clock, abort=lambda: self.escalated)

    def raise_if_received(self, *, workers: bool = True) -> None:
        """``workers``: some were started (the message says they were stopped)."""
        if self.signum is not None:
            raise Interrupted(self.signum, workers=workers)
