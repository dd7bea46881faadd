"""Read a worker's process-tree counters for the activity evidence (``unicron.detect.activity``)."""

from __future__ import annotations

import psutil

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


def tree_usage(pid: int, now: float) -> Usage | None:
    """CPU seconds and I/O bytes of ``pid`` and its descendants; None when ``pid`` is gone."""
    try:
        leader = psutil.Process(pid)
        members = [leader, *leader.children(recursive=True)]
    except psutil.Error:
        return None
    cpu, moved = 0.0, 0
    for proc in members:
        try:
            c, m = _one(proc)
        except psutil.Error:
            continue  # a descendant that exited between listing and reading
        cpu += c
        moved += m
    return Usage(ts=now, cpu_s=cpu, io_bytes=moved)
