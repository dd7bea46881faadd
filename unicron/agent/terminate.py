"""Stopping whole worker process trees: ``terminate_all``.

A worker's tree is its process group (one ``killpg`` reaches it), every descendant that left
the group (found by walking the tree with psutil, including a snapshot taken while its parent
was still alive), and the orphans re-parented to the agent (a child subreaper) that a worker
left behind. Everything found is signalled, given the grace period, SIGKILLed if still there,
and reaped, zombies included.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import psutil

from unicron.agent.procs import POLL_SLICE_S, WorkerProcess

# How long a worker already exiting on its own is left to finish before it is signalled too.
EXITING_S = 2.0
# How long a rank that raised may take to exit before it is said to linger: torch's own teardown
# takes about 2 s on a loaded host (acceptance 25A F5: said at 2 s of an ordinary exit).
LINGER_NOTICE_S = 5.0


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


def _send(workers: Sequence[WorkerProcess], targets: Mapping[int, psutil.Process], sig: int,
          spare: Collection[int] = ()) -> None:
    """Signal each live group once through killpg, and every process outside those groups
    directly; the ``spare`` pids themselves not (the rest of their groups and trees, yes)."""
    grouped: set[int] = set()
    for worker in workers:
        if worker.returncode is None and worker.pid not in spare:  # not reaped: its pid (= pgid) cannot have been reused
            try:
                os.killpg(worker.pgid, sig)
                grouped.add(worker.pgid)
            except (ProcessLookupError, PermissionError):
                pass
    for proc in targets.values():
        if proc.pid in spare:
            continue
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
        time.sleep(min(POLL_SLICE_S, remaining))


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
    exiting: Collection[int] = (),
    exiting_s: float = EXITING_S,
    exiting_first: bool = False,
    lingering: Callable[[list[int]], None] | None = None,
) -> TerminationReport:
    """Stop every worker's whole tree: ``sig``, up to ``grace_s`` to exit, then SIGKILL; reap all.

    Also cleans up after workers that already exited (their leftover children). ``abort()``
    returning True ends the grace period early (a second Ctrl-C). ``adopted()``: pids of
    orphans re-parented to this process (a child subreaper) to stop with their trees: what a
    worker left behind in a session of its own after it exited is no longer in its tree.
    ``exiting``: pids of workers already on their way out (their script raised, or called
    ``sys.exit``): they get ``sig`` only if still there after ``exiting_s``. torchrun never
    signals a rank that failed, since it learns of the failure from its exit; a script's SIGTERM
    handler (save a checkpoint and exit) run in the middle of a crashed rank's teardown printed
    a traceback that was not the job's cause (acceptance 23C F1). ``exiting_first``: nobody is
    signalled until they are gone (or ``exiting_s`` passed), as under torchrun, which stops the
    others only once the failed rank exited: its atexit hooks, and a checkpoint it was still
    writing with its peers (``dcp.async_save``), are not cut off. Then the grace period starts.
    ``lingering(pids)`` is told of those still there after ``LINGER_NOTICE_S`` (an atexit hook
    at work, a non-daemon thread that keeps the interpreter), before the rest of that wait.
    """
    start = begin = clock()
    seen: dict[int, psutil.Process] = {}
    targets = _collect(workers, seen, adopted)
    spare = {pid for pid in exiting if pid in targets} if sig not in (signal.SIGKILL, signal.SIGCONT) else set()
    if spare and exiting_first:
        still = _wait_gone(workers, {pid: targets[pid] for pid in spare}, start + min(LINGER_NOTICE_S, exiting_s),
                           clock, abort)
        if still and lingering is not None and exiting_s > LINGER_NOTICE_S:
            lingering(still)
            _wait_gone(workers, {pid: targets[pid] for pid in still}, start + exiting_s, clock, abort)
        targets, spare = _collect(workers, seen, adopted), set()  # still there: stopped as the others
        begin = clock()
    signalled = tuple(sorted(set(targets) - spare))
    _send(workers, targets, sig, spare)
    if sig not in (signal.SIGKILL, signal.SIGCONT):
        # A stopped process (SIGSTOP, a debugger, a job-control suspend) holds the signal until
        # it is continued: continue it, so it exits now rather than at SIGKILL after the grace.
        _send(workers, targets, signal.SIGCONT)
    if spare:
        late = _wait_gone(workers, {pid: targets[pid] for pid in spare}, begin + min(exiting_s, grace_s), clock, abort)
        if late:  # its teardown is stuck (a non-daemon thread, a hung finalizer): as the others
            for pid in late:
                try:
                    targets[pid].send_signal(sig)
                except psutil.Error:
                    pass
            signalled = tuple(sorted(set(signalled) | set(late)))
    alive = _wait_gone(workers, targets, begin + grace_s, clock, abort)
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
