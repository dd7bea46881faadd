"""Read a worker's process-tree counters for the activity evidence (``unicron.detect.activity``)."""

from __future__ import annotations

import time

import psutil

from unicron.agent.proctree import tree_of
from unicron.detect.activity import Usage


def _one(proc: psutil.Process) -> tuple[float, int]:
    with proc.oneshot():
        t = proc.cpu_times()
        # children_*: time of children this process already reaped (a data loader that exited).
        cpu = t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        try:
            io = proc.io_counters()
            moved = getattr(io, "read_chars", io.read_bytes) + getattr(io, "write_chars", io.write_bytes)
        except (psutil.AccessDenied, AttributeError, NotImplementedError):
            moved = 0
    return cpu, int(moved)


def tree_usage(pid: int) -> Usage | None:
    """CPU seconds and I/O bytes of ``pid`` and its descendants, stamped with the time they were
    read (``time.monotonic``); None when ``pid`` is gone."""
    members = tree_of(pid)
    cpu, moved = 0.0, 0
    for n, member in enumerate(members):
        try:
            c, m = _one(psutil.Process(member))
        except psutil.Error:
            if n == 0:
                return None  # the worker itself is gone
            continue  # a descendant that exited between listing and reading
        cpu += c
        moved += m
    return Usage(ts=time.monotonic(), cpu_s=cpu, io_bytes=moved)
