"""Read a worker's process-tree counters for the activity evidence (``unicron.detect.activity``)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass

import psutil

from unicron.agent.proctree import tree_of
from unicron.agent.sendqueues import SendQueueWatch
from unicron.detect.activity import Usage


def _one(proc: psutil.Process) -> tuple[float, float, int]:
    """(own CPU seconds, reaped children's CPU seconds, I/O bytes) of one process."""
    with proc.oneshot():
        t = proc.cpu_times()
        # children_*: time of children this process already reaped (a data loader that exited).
        reaped = getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        try:
            io = proc.io_counters()
            # read()/write() count their bytes when they return: one write() of a 2 GB tensor
            # (torch.save) shows nothing for as long as it takes. Storage bytes count as pages
            # are dirtied or read, during the call, so a long write is seen while it runs.
            moved = io.read_bytes + io.write_bytes
            moved += getattr(io, "read_chars", 0) + getattr(io, "write_chars", 0)
        except (psutil.AccessDenied, AttributeError, NotImplementedError):
            moved = 0
    return t.user + t.system, reaped, int(moved)


# write(2)-family syscall numbers: a thread blocked in one of them on fd 1 or 2 waits for the
# reader of its output. Other architectures fall back to not knowing (never output-bound).
_WRITE_SYSCALLS = {"x86_64": {1, 18, 20, 296, 328}, "aarch64": {64, 66, 68, 70, 287}}.get(platform.machine(), set())


@dataclass(frozen=True)
class Threads:
    """What one process's threads were doing when sampled."""

    storage_wait: bool = False  # one was in uninterruptible sleep (D): a wait on storage
    output_wait: bool = False  # one was blocked writing its stdout/stderr into a full pipe or a stopped tty
    runq_s: float = 0.0  # seconds its threads have waited on a run queue, in all
    runnable: bool = False  # one was running or waiting for a CPU (R)


def thread_states(pid: int, *, output: bool = False) -> Threads:
    """Read each thread of ``pid``: its state (``stat``), its run-queue wait (``schedstat``), and
    with ``output`` whether a sleeping one is blocked writing to fd 1 or 2 (``syscall``).

    A thread in uninterruptible sleep (D) waits on storage (writeback an ``fsync`` waits for, a
    page read from a slow or network disk); a peer in a collective waits interruptibly."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return Threads()
    storage = blocked = runnable = False
    runq_ns = 0
    for tid in tids:
        task = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{task}/stat", "rb") as fh:
                stat = fh.read()
            with open(f"{task}/schedstat", "rb") as fh:
                runq_ns += int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile, or no schedstat in this kernel
        # "tid (comm) S ...": the name may hold spaces and parentheses; the state follows the last ")".
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
        storage = storage or state == b"D"
        runnable = runnable or state == b"R"
        if output and not blocked and state == b"S":
            blocked = _writes_output(pid, task)
    return Threads(storage_wait=storage, output_wait=blocked, runq_s=runq_ns / 1e9, runnable=runnable)


def _writes_output(pid: int, task: str) -> bool:
    """Whether the sleeping thread at ``task`` is inside a write to stdout or stderr, and that
    fd is a pipe or a terminal (a full pipe or a stopped tty blocks it; a socket write is a
    peer's business, never counted here)."""
    try:
        with open(f"{task}/syscall") as fh:
            fields = fh.read().split()
        if len(fields) < 2 or not fields[0].isdigit() or int(fields[0]) not in _WRITE_SYSCALLS:
            return False
        fd = int(fields[1], 16)
        if fd not in (1, 2):
            return False
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except (OSError, ValueError):
        return False  # not ours to read (ptrace rules), or gone
    return target.startswith("pipe:") or target.startswith("/dev/pts/") or target.startswith("/dev/tty")


def tree_usage(pid: int, sendq: SendQueueWatch | None = None) -> Usage | None:
    """CPU seconds and I/O bytes of ``pid`` and its descendants (and the descendants' part of
    the CPU), stamped with the time they were read (``time.monotonic``); None when ``pid`` is
    gone. With ``sendq``, also the bytes ``pid``'s own TCP send queues drained so far."""
    members = tree_of(pid)
    own, helpers, moved = 0.0, 0.0, 0
    storage_wait = output_wait = False
    runq, helper_runq = 0.0, 0.0
    runnable = helper_runnable = False
    for n, member in enumerate(members):
        try:
            c, reaped, m = _one(psutil.Process(member))
        except psutil.Error:
            if n == 0:
                return None  # the worker itself is gone
            continue  # a descendant that exited between listing and reading
        if n == 0:
            own = c
        else:
            helpers += c
        helpers += reaped  # every descendant's time, live or reaped, is its helpers'
        moved += m
        threads = thread_states(member, output=n == 0)
        storage_wait = storage_wait or threads.storage_wait
        output_wait = output_wait or threads.output_wait
        runq += threads.runq_s
        if n > 0:
            helper_runq += threads.runq_s
            helper_runnable = helper_runnable or threads.runnable
        else:
            runnable = threads.runnable
    drained = sendq.drained(pid) if sendq is not None else 0
    return Usage(ts=time.monotonic(), cpu_s=own + helpers, io_bytes=moved, helper_cpu_s=helpers,
                 storage_wait=storage_wait, net_drained=drained, runq_s=runq, helper_runq_s=helper_runq,
                 output_wait=output_wait, runnable=runnable, helper_runnable=helper_runnable)
