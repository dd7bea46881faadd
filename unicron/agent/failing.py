"""Ranks caught in the middle of failing when a stop comes.

A rank that fails in native code often breaks its peers before its own exception reaches
Python: gloo logs ``[E... ProcessGroupGloo.cpp] Gloo connectFullMesh failed``, tears its
connections down (its peers fail at once: "Connection closed by peer"), and only then throws.
The peers' reports stop the attempt, and a stop that killed the rank at once would lose the
root cause: every restart would then be blamed on a victim. So a stop first waits, briefly, for
ranks whose stderr has just shown an error and that have not reported yet (their exception
report, or their exit, comes within milliseconds to a second). Healthy ranks never wait: a
rank stuck in a collective writes no error.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterable

from unicron.agent.proctree import is_exiting
from unicron.agent.ranks import RankState

WAIT_S = 1.0  # the longest a stop waits for ranks that are failing
RECENT_S = 1.0  # an error line written this long before the stop counts
TAIL_BYTES = 2048

# What a failure prints before its report: glog-style error/fatal lines (c10d, gloo, NCCL), a
# Python traceback on its way out, a C++ exception escaping to std::terminate.
_ERROR_MARK = re.compile(rb"^(?:\[?[EF]\d{4} \d\d:\d\d:\d\d|Traceback \(most recent call last\):"
                         rb"|terminate called after throwing)", re.MULTILINE)


def looks_failing(stderr_path: str | None, now: float, recent_s: float = RECENT_S) -> bool:
    """The rank's stderr was written in the last ``recent_s`` and its last lines show an error."""
    if not stderr_path:
        return False
    try:
        with open(stderr_path, "rb") as f:
            st = os.fstat(f.fileno())
            if now - st.st_mtime > recent_s:
                return False
            f.seek(max(0, st.st_size - TAIL_BYTES))
            tail = f.read()
    except OSError:
        return False
    return bool(_ERROR_MARK.search(tail))


def failing_ranks(ranks: Iterable[RankState], now: float) -> list[int]:
    """Live ranks that have not reported a failure yet and whose stderr shows one under way (one
    that exits is done: its exit is the report)."""
    return [r.rank for r in ranks
            if r.exitcode is None and not r.exception_fatal and r.exiting_code is None
            and (r.closed_raising or looks_failing(r.logs.stderr_path, now))
            and r.proc.poll() is None and not is_exiting(r.proc.pid)]


def wait_for_failing(ranks: Iterable[RankState], drain: Callable[[], object], wait_s: float = WAIT_S) -> None:
    """Up to ``wait_s``, while some rank is failing, ``drain()`` the workers' messages (their
    exception reports)."""
    ranks = list(ranks)
    deadline = time.monotonic() + wait_s
    while failing_ranks(ranks, time.time()) and time.monotonic() < deadline:
        time.sleep(0.01)
        drain()
