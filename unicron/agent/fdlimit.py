"""Open files a launcher needs for its local ranks, and raising the soft limit to match.

The launcher holds a few descriptors per local rank (its stderr copy and echo, the pidfd it
waits on, the channel's and the warm pool's pipes) beside a few dozen of its own (ZeroMQ's
sockets and wake-up fds, the coordinator's). Under the common soft limit of 1024 a node with a
few hundred local ranks (`--nproc-per-node cpu` on a large host) ran out, and the launcher died
of an internal ZeroMQ error. torchrun needs fewer and runs.
"""

from __future__ import annotations

import os
import resource

from unicron.errors import ResourceError

BASE_FDS = 48  # the launcher's own (about 35 measured)
FDS_PER_RANK = 6  # about 4 measured
# Checked before an attempt's ranks start, against what is open then: ZeroMQ's I/O thread meets
# a full table in accept() as a rank connects and aborts the process (no Python handler runs).
HELD_PER_RANK = 4  # measured: 40 open with 2 ranks, 64 with 8, 96 with 16
SPARE_FDS = 12  # connections being accepted, log files reopened at a restart
LAUNCHER_FDS = 28  # what the launcher opens for itself once it runs (about 32 measured, a few open at start)


def needed_fds(nproc: int) -> int:
    """Descriptors a launcher with ``nproc`` local ranks should be allowed (pure)."""
    return BASE_FDS + FDS_PER_RANK * max(1, nproc)


def soft_limit_for(nproc: int, soft: int, hard: int) -> tuple[int | None, str]:
    """The soft limit to set (None: ``soft`` is enough), and a warning when even the hard limit
    is below what the ranks need (pure): the launcher then goes on at the hard limit, as
    torchrun would go on, and may run out."""
    need = needed_fds(nproc)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None, ""
    if hard != resource.RLIM_INFINITY and hard < need:
        return (hard if hard > soft else None), (f"{nproc} local ranks may need about {need} open files; the limit "
                                                 f"is {hard} (ulimit -Hn): raise it if the launcher runs out")
    return need, ""


def ensure_fd_limit(nproc: int) -> str:
    """Raise this process's soft limit on open files when its ranks need it (its children
    inherit it, as they would a `ulimit -n` in the launching shell); returns a warning, or "".
    Raises ResourceError when even the launcher and its ranks cannot fit under it: ZeroMQ meets
    a full table in its own threads, where no error reaches Python (a node joining its own
    coordinator then waited for the join timeout, 600 s, with nothing said)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target, warning = soft_limit_for(nproc, soft, hard)
    if target is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    _raise_if(room_problem(nproc, _open_now(), soft, own=LAUNCHER_FDS))
    return warning


def room_problem(nproc: int, open_now: int, soft: int, *, own: int = 0) -> str:
    """Why ``nproc`` ranks (and ``own`` descriptors the launcher will open for itself) cannot be
    started with ``open_now`` descriptors open under the soft limit ``soft`` ("" when they
    can) (pure)."""
    need = own + HELD_PER_RANK * max(1, nproc) + SPARE_FDS
    if soft == resource.RLIM_INFINITY or open_now + need <= soft:
        return ""
    whose = f"{nproc} local ranks" + (" and the launcher" if own else "")
    return (f"out of open files: {whose} need about {need} descriptors beyond the {open_now} this "
            f"launcher holds, and the limit is {soft} (ulimit -n); raise it, or start fewer ranks per node")


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0  # no /proc: nothing to go by


def _raise_if(problem: str) -> None:
    if problem:
        raise ResourceError(problem)


def check_room(nproc: int) -> None:
    """Raise ResourceError, before any rank of the attempt starts, when its ranks would exhaust
    the open files (the launcher would abort in ZeroMQ instead, with ranks half started)."""
    _raise_if(room_problem(nproc, _open_now(), resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
