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


def exiting_from_stat(stat: bytes) -> bool:
    """Whether a ``/proc/PID/stat`` line shows a process that has begun to exit: a zombie (or
    dead) state, or ``PF_EXITING`` in its flags (field 9). The command name (field 2) may hold
    spaces and parentheses, so fields are counted after its last ``)``."""
    fields = stat[stat.rindex(b")") + 2:].split()
    return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)


def process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc (R, S, D, T, Z...; "?" if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        return stat[stat.rindex(b")") + 2:].split()[0].decode()
    except (OSError, ValueError, IndexError):
        return "?"


def is_exiting(pid: int) -> bool:
    """Whether ``pid`` has begun to exit (or is gone). A killed process closes its sockets before
    it becomes a zombie its parent can reap, so its peers can fail on it in that window: this
    sees it from the first moment of its exit. False where /proc cannot say (not Linux)."""
    if not _HAVE_PROC:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        return exiting_from_stat(stat)
    except (ValueError, IndexError):
        return False
