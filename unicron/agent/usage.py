"""Read a worker's process-tree counters for the activity evidence (``unicron.detect.activity``)."""

from __future__ import annotations

import os
import time

import psutil

from unicron.agent.proctree import tree_of
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


def in_storage_wait(pid: int) -> bool:
    """Whether a thread of ``pid`` is in uninterruptible sleep (state D): in Linux, a wait on
    storage (writeback an ``fsync`` waits for, a page read from a slow or network disk)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue  # the thread ended meanwhile
        # "tid (comm) S ...": the name may hold spaces and parentheses; the state follows the last ")".
        if stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] == b"D":
            return True
    return False


def tree_usage(pid: int) -> Usage | None:
    """CPU seconds and I/O bytes of ``pid`` and its descendants (and the descendants' part of
    the CPU), stamped with the time they were read (``time.monotonic``); None when ``pid`` is
    gone."""
    members = tree_of(pid)
    own, helpers, moved, storage_wait = 0.0, 0.0, 0, False
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
        storage_wait = storage_wait or in_storage_wait(member)
    return Usage(ts=time.monotonic(), cpu_s=own + helpers, io_bytes=moved, helper_cpu_s=helpers,
                 storage_wait=storage_wait)
