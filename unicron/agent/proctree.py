"""Children of a process from /proc/PID/task/TID/children: a process tree without scanning /proc.

psutil's ``children()`` reads the parent of every process on the machine; on a GPU node with
thousands of processes that is tens of milliseconds per call. The kernel's per-thread
``children`` files list only what we ask about. Where they are missing (a kernel without
CONFIG_PROC_CHILDREN, or not Linux) psutil is the fallback.
"""

from __future__ import annotations

import os

import psutil

_HAVE_CHILDREN_FILES = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")


def children_of(pid: int) -> list[int]:
    """Pids of the direct children of ``pid`` (any of its threads); [] if it is gone."""
    if not _HAVE_CHILDREN_FILES:
        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.Error:
            return []
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                found.extend(int(p) for p in fh.read().split())
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return found


def tree_of(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents first."""
    tree, i = [pid], 0
    while i < len(tree):
        tree.extend(children_of(tree[i]))
        i += 1
    return tree


_HAVE_PROC = os.path.exists(f"/proc/{os.getpid()}/stat")
PF_EXITING = 0x4  # include/linux/sched.h: set as the task starts to exit, before its files close


def stat_fields(stat: bytes) -> list[bytes]:
    """Fields 3 on of a ``/proc/PID/stat`` line (``[0]`` the state, ``[6]`` the flags). The
    command name (field 2) may hold spaces and parentheses: fields count from its last ``)``."""
    return stat[stat.rindex(b")") + 2:].split()


def exiting_from_stat(stat: bytes) -> bool:
    """Whether a ``/proc/PID/stat`` line shows a process that has begun to exit: a zombie (or
    dead) state, or ``PF_EXITING`` in its flags (field 9)."""
    fields = stat_fields(stat)
    return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)


def _read_stat(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return fh.read()


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (R, S, D, T, Z...; "?" if unknown)."""
    try:
        return stat_fields(_read_stat(pid))[0].decode()
    except (OSError, ValueError, IndexError):
        return "?"


def is_exiting(pid: int) -> bool:
    """Whether ``pid`` has begun to exit (or is gone). A killed process closes its sockets before
    it becomes a zombie its parent can reap, so its peers can fail on it in that window: this
    sees it from the first moment of its exit. False where /proc cannot say (not Linux)."""
    if not _HAVE_PROC:
        return False
    try:
        stat = _read_stat(pid)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return exiting_from_stat(stat)
    except (ValueError, IndexError):
        return False


def tracer_of(pid: int) -> int | None:
    """The pid of the process tracing ``pid`` (a debugger attached from outside: ``gdb -p``,
    ``strace -p``, ``py-spy dump --native``), None when untraced, gone, or not Linux."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("TracerPid:"):
                    tracer = int(line.split()[1])
                    return tracer or None
    except (OSError, ValueError, IndexError):
        pass
    return None
