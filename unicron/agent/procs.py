"""Worker processes: spawn, notice an exit at once, stop whole process trees, forward signals.

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
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
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
_POLL_SLICE_S = 0.01
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
                if select.select(list(wake_fds), [], [], min(_POLL_SLICE_S, remaining))[0]:
                    break
            else:
                time.sleep(min(_POLL_SLICE_S, remaining))
            if any(w.poll() is not None for w in workers):
                break
    return [w for w in workers if w.poll() is not None]


@dataclass(frozen=True)
class TerminationReport:
    """What stopping the workers took."""

    signalled: tuple[int, ...]  # pids that got the first signal
    killed: tuple[int, ...]  # pids still alive after the grace period, then SIGKILLed
    survivors: tuple[int, ...]  # pids alive even after SIGKILL (stuck in the kernel)
    elapsed_s: float


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _collect(workers: Sequence[WorkerProcess], found: dict[int, psutil.Process],
             adopted: Callable[[], Iterable[int]] | None = None) -> dict[int, psutil.Process]:
    """Every live process of the workers' trees: leaders, descendants, and members of their
    groups, and the trees of the ``adopted`` pids (see ``terminate_all``).

    ``found`` accumulates everything seen, zombies included (they are reaped at the end).
    """
    me = os.getpid()
    for pid in adopted() if adopted is not None else ():
        try:
            orphan = psutil.Process(pid)
            found.setdefault(pid, orphan)
            for proc in orphan.children(recursive=True):
                found.setdefault(proc.pid, proc)
        except psutil.Error:
            continue
    groups: dict[int, WorkerProcess] = {w.pgid: w for w in workers}
    for worker in workers:
        worker.poll()
        leader = worker.process()
        if leader is not None and worker.returncode is None:
            found.setdefault(leader.pid, leader)
        for proc in worker.refresh_descendants():
            found.setdefault(proc.pid, proc)
    for proc in psutil.process_iter():
        try:
            pgid = os.getpgid(proc.pid)
        except OSError:
            continue
        owner = groups.get(pgid)
        # A reaped leader's pid may be reused by a new session leader: never adopt that one.
        if owner is not None and not (proc.pid == pgid and owner.returncode is not None):
            found.setdefault(proc.pid, proc)
    found.pop(me, None)
    return {pid: proc for pid, proc in found.items() if not _gone(proc)}


def _send(workers: Sequence[WorkerProcess], targets: Mapping[int, psutil.Process], sig: int) -> None:
    """Signal each live group once through killpg, and every process outside those groups directly."""
    grouped: set[int] = set()
    for worker in workers:
        if worker.returncode is None:  # not reaped: its pid (= pgid) cannot have been reused
            try:
                os.killpg(worker.pgid, sig)
                grouped.add(worker.pgid)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in targets.values():
        try:
            if os.getpgid(proc.pid) in grouped:
                continue
        except OSError:
            continue
        try:
            proc.send_signal(sig)  # psutil refuses if the pid now belongs to another process
        except psutil.Error:
            pass


def _wait_gone(
    workers: Sequence[WorkerProcess],
    targets: Mapping[int, psutil.Process],
    deadline: float,
    clock: Callable[[], float],
    abort: Callable[[], bool] | None = None,
) -> list[int]:
    """Wait until every target is gone (or a zombie); returns the pids still alive at the deadline."""
    while True:
        for worker in workers:
            worker.poll()
        alive = [pid for pid, proc in targets.items() if not _gone(proc)]
        if not alive:
            return []
        remaining = deadline - clock()
        if remaining <= 0 or (abort is not None and abort()):
            return alive
        time.sleep(min(_POLL_SLICE_S, remaining))


def _reap_dead(
    workers: Sequence[WorkerProcess], seen: Mapping[int, psutil.Process], survivors: Sequence[int],
    timeout_s: float = 2.0,
) -> None:
    """Reap every dead worker (through its handle) and every descendant that became our child
    (when the agent is a child subreaper); ``survivors`` are alive and not waited for.

    A dying multi-threaded process shows as a zombie before the kernel lets its parent reap it
    (its other threads are still exiting), and its own children, zombies included, are handed
    to us only when its last thread is gone. So a worker or descendant that is not reapable yet,
    or is still the child of another dying descendant, is retried for up to ``timeout_s``
    instead of being left a zombie (or a dead worker without its exit code).
    """
    leaders = {w.pid for w in workers}
    dead_workers = list(workers)  # every worker is polled at least once, survivors too
    pending = [pid for pid in seen if pid not in leaders]
    deadline = time.monotonic() + timeout_s
    while True:
        dead_workers = [w for w in dead_workers if w.poll() is None and w.pid not in survivors]
        waiting = []
        for pid in pending:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                if _parent_in(seen[pid], seen):
                    waiting.append(pid)  # not handed to us yet: its parent is still exiting
                continue
            if done == 0:
                waiting.append(pid)
        pending = waiting
        if (not pending and not dead_workers) or time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _parent_in(proc: psutil.Process, seen: Mapping[int, psutil.Process]) -> bool:
    """Whether ``proc`` still exists and its parent is one of the processes being stopped."""
    try:
        return proc.is_running() and proc.ppid() in seen
    except psutil.Error:
        return False


def terminate_all(
    workers: Sequence[WorkerProcess],
    grace_s: float,
    *,
    sig: int = signal.SIGTERM,
    clock: Callable[[], float] = time.monotonic,
    kill_wait_s: float = 5.0,
    abort: Callable[[], bool] | None = None,
    adopted: Callable[[], Iterable[int]] | None = None,
) -> TerminationReport:
    """Stop every worker's whole tree: ``sig``, up to ``grace_s`` to exit, then SIGKILL; reap all.

    Also cleans up after workers that already exited (their leftover children). ``abort()``
    returning True ends the grace period early (a second Ctrl-C). ``adopted()``: pids of
    orphans re-parented to this process (a child subreaper) to stop with their trees: what a
    worker left behind in a session of its own after it exited is no longer in its tree.
    """
    start = clock()
    seen: dict[int, psutil.Process] = {}
    targets = _collect(workers, seen, adopted)
    signalled = tuple(sorted(targets))
    _send(workers, targets, sig)
    if sig not in (signal.SIGKILL, signal.SIGCONT):
        # A stopped process (SIGSTOP, a debugger, a job-control suspend) holds the signal until
        # it is continued: continue it, so it exits now rather than at SIGKILL after the grace.
        _send(workers, targets, signal.SIGCONT)
    alive = _wait_gone(workers, targets, start + grace_s, clock, abort)
    killed: tuple[int, ...] = ()
    survivors: list[int] = []
    if alive:
        # Re-walk: the grace period may have forked new processes.
        targets = _collect(workers, seen, adopted)
        killed = tuple(sorted(targets))
        _send(workers, targets, signal.SIGKILL)
        # Dying after SIGKILL takes real time whatever clock the grace was measured with.
        survivors = _wait_gone(workers, targets, time.monotonic() + kill_wait_s, time.monotonic)
    _reap_dead(workers, seen, survivors)
    return TerminationReport(signalled, killed, tuple(survivors), clock() - start)
