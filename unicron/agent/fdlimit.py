"""Open files a launcher needs for its local ranks, and raising the soft limit to match.

The launcher holds a few descriptors per local rank (its stderr copy and echo, the pidfd it
waits on, the channel's and the warm pool's pipes) beside a few dozen of its own (ZeroMQ's
sockets and wake-up fds, the coordinator's). Under the common soft limit of 1024 a node with a
few hundred local ranks (`--nproc-per-node cpu` on a large host) ran out, and the launcher died
of an internal ZeroMQ error. torchrun needs fewer and runs.
"""

from __future__ import annotations

import resource

BASE_FDS = 48  # the launcher's own (about 35 measured)
FDS_PER_RANK = 6  # about 4 measured


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
    inherit it, as they would a `ulimit -n` in the launching shell); returns a warning, or ""."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target, warning = soft_limit_for(nproc, soft, hard)
    if target is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return warning
