"""Worker processes: spawn, notice an exit at once, forward signals (stopping trees: ``terminate``).

Every worker starts in its own session (so its process group id is its pid): one ``killpg``
reaches the worker and everything it forked that stayed in the group, such as DataLoader
workers. A descendant that left the group (``setsid``) is found by walking the tree with psutil,
including a snapshot taken while its parent was still alive (``refresh_descendants``).
Exits are seen through a pidfd (Linux >= 5.3) in ``select.poll``, so the agent wakes the moment
a worker dies instead of on its next monitor tick.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import select
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import psutil

from unicron.agent.logs import RankLogs
from unicron.agent.tee import ConsoleTee
from unicron.errors import FatalUserError, WorkerFailedError

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
# Why a program cannot be started that is the user's to fix (a restart would meet it again);
# anything else (EAGAIN, ENOMEM, EMFILE: the node's resources) is not the program's fault.
_NOT_RUNNABLE = frozenset({errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.EISDIR,
                           errno.ENAMETOOLONG, errno.ELOOP})
POLL_SLICE_S = 0.01
_PR_SET_CHILD_SUBREAPER = 36


def _open_pidfd(pid: int) -> int | None:
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return int(pidfd_open(pid))
    except OSError:
        return None


class ChildHandle(Protocol):
    """What a worker is to us: a ``subprocess.Popen``, or a zygote's fork re-parented to us."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class WorkerProcess:
    """One spawned worker (the leader of its own process group)."""

    def __init__(
        self,
        popen: ChildHandle,
        *,
        local_rank: int,
        rank: int,
        cmd: Sequence[str],
        logs: RankLogs | None = None,
    ) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.pgid = popen.pid  # start_new_session: the worker leads its group
        self.local_rank = local_rank
        self.rank = rank
        self.cmd = list(cmd)
        self.logs = logs
        self.started_at = time.time()
        self.exited_at: float | None = None  # unix time the exit was seen
        self._pidfd = _open_pidfd(self.pid)
        self._exit_callbacks: list[Callable[[], None]] = []
        self._descendants: dict[int, psutil.Process] = {}
        try:
            self._process: psutil.Process | None = psutil.Process(self.pid)
        except psutil.Error:
            self._process = None

    def __repr__(self) -> str:
        return f"WorkerProcess(rank={self.rank}, local_rank={self.local_rank}, pid={self.pid}, rc={self.returncode})"

    @property
    def returncode(self) -> int | None:
        """None while running; negative = killed by that signal (as subprocess reports it)."""
        return self.popen.returncode

    def poll(self) -> int | None:
        """Reap the worker if it has exited; returns its return code or None."""
        if self.exited_at is not None:
            return self.popen.returncode
        code = self.popen.poll()
        if code is not None:
            self._exited()
        return code

    def fileno(self) -> int | None:
        """A pidfd that becomes readable when the worker exits (None where unsupported)."""
        return self._pidfd

    def add_exit_callback(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once when the exit is seen (at once if it already was)."""
        if self.exited_at is not None:
            callback()
        else:
            self._exit_callbacks.append(callback)

    def refresh_descendants(self) -> list[psutil.Process]:
        """Remember the worker's current descendants, so they can be stopped even after it dies."""
        if self._process is not None and self.popen.returncode is None:
            try:
                for child in self._process.children(recursive=True):
                    self._descendants[child.pid] = child
            except psutil.Error:
                pass
        return list(self._descendants.values())

    def process(self) -> psutil.Process | None:
        return self._process

    def close(self) -> None:
        """Release the pidfd (the process itself is left alone)."""
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _exited(self) -> None:
        self.exited_at = time.time()
        self.close()
        callbacks, self._exit_callbacks = self._exit_callbacks, []
        for callback in callbacks:
            callback()


def spawn(
    cmd: Sequence[str],
    env: Mapping[str, str],
    *,
    local_rank: int,
    rank: int | None = None,
    stdout: str | None = None,
    stderr: str | None = None,
    cwd: str | None = None,
    inherit_env: bool = True,
    logs: RankLogs | None = None,
) -> WorkerProcess:
    """Start ``cmd`` in a new session with ``env`` (on top of the agent's environment, as torchrun).

    ``stdout``/``stderr``: a file path (created/truncated; os.devnull works) or None for the console.
    A program that cannot be started raises ``FatalUserError`` (a user error: missing, not
    executable), else ``WorkerFailedError`` (the node could not start it: no pids, memory, fds).
    """
    full_env = dict(os.environ) if inherit_env else {}
    full_env.update(env)
    with contextlib.ExitStack() as files:  # the child keeps its copies; ours close after the fork
        out = files.enter_context(open(stdout, "wb")) if stdout else None
        err = files.enter_context(open(stderr, "wb")) if stderr else None
        try:
            popen = subprocess.Popen(
                list(cmd), env=full_env, cwd=cwd, stdout=out, stderr=err, start_new_session=True
            )
        except OSError as error:
            text = f"cannot start worker {local_rank}: {cmd[0]}: {error.strerror}"
            if error.errno in _NOT_RUNNABLE:  # no such program, not executable, bad cwd
                raise FatalUserError(text) from None
            raise WorkerFailedError(text) from None
    return WorkerProcess(
        popen, local_rank=local_rank, rank=local_rank if rank is None else rank, cmd=cmd, logs=logs
    )


def start_worker(
    cmd: Sequence[str],
    env: Mapping[str, str],
    logs: RankLogs,
    *,
    tee: ConsoleTee | None = None,
    cwd: str | None = None,
    inherit_env: bool = True,
) -> WorkerProcess:
    """Spawn one rank with its logs planned by ``RunLogDir.prepare_attempt``: files, error file, tee."""
    worker_env = dict(env)
    # torchrun sets an empty TORCHELASTIC_ERROR_FILE when logs go to /dev/null.
    worker_env[ERROR_FILE_ENV] = logs.error_file or ""
    worker = spawn(
        cmd,
        worker_env,
        local_rank=logs.local_rank,
        rank=logs.rank,
        stdout=logs.stdout_path,
        stderr=logs.stderr_path,
        cwd=cwd,
        inherit_env=inherit_env,
        logs=logs,
    )
    if tee is not None:
        worker.add_exit_callback(tee.follow_rank(logs))
    return worker


def running(workers: Iterable[WorkerProcess]) -> list[WorkerProcess]:
    return [w for w in workers if w.poll() is None]


def wait_any(
    workers: Sequence[WorkerProcess], timeout_s: float, *, wake_fds: Sequence[int] = ()
) -> list[WorkerProcess]:
    """Wait until one of ``workers`` has exited, ``timeout_s`` passes, or a ``wake_fds`` is readable.

    Returns the workers of the list that have exited (empty on timeout or wake-up). Pass only
    running workers: one that exited earlier makes this return at once.
    """
    exited = [w for w in workers if w.poll() is not None]
    if exited or timeout_s <= 0:
        return exited
    pidfds = [w.fileno() for w in workers]
    if all(fd is not None for fd in pidfds):
        poller = select.poll()
        for fd in [*pidfds, *wake_fds]:
            poller.register(fd, select.POLLIN)  # type: ignore[arg-type]
        poller.poll(math.ceil(timeout_s * 1000))
    else:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if wake_fds:
                if select.select(list(wake_fds), [], [], min(POLL_SLICE_S, remaining))[0]:
                    break
            else:
                time.sleep(min(POLL_SLICE_S, remaining))
            if any(w.poll() is not None for w in workers):
                break
    return [w for w in workers if w.poll() is not None]
