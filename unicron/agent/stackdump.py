"""Every live worker's Python stack, on demand.

The injected hooks register faulthandler for ``STACK_SIGNAL`` (SIGRTMIN+4, not SIGUSR1: scripts
handle that one themselves), writing to a file of the worker's own in
the agent's stack directory, so a dump comes even from a worker blocked inside a C++ collective
(faulthandler runs in the signal handler, without the GIL). A worker asked that gives none in
``STACK_WAIT_S`` is stopped, or stuck where no Python runs: "" in the result, a suspect when the
others all wait in a collective (``unicron.detect.stacks``).
"""

from __future__ import annotations

import linecache
import os
import time
from pathlib import Path

from unicron.detect.stacks import annotate_sources
from unicron.worker.env import STACK_SIGNAL

STACK_WAIT_S = 1.5
STACK_KEEP_CHARS = 20_000  # of one rank's dump (its end is kept)
STACKS_TOTAL_CHARS = 1_000_000  # of a node's dumps together


def dump_stacks(pids: dict[int, int], stack_dir: str, wait_s: float = STACK_WAIT_S) -> dict[str, str]:
    """Signal (``STACK_SIGNAL``) each rank's process (``rank -> pid``) and read what each appends to its file
    ``rank<N>.txt``; returns ``str(rank) -> stack text``."""
    paths = {}
    for rank, pid in pids.items():
        path = Path(stack_dir) / f"rank{rank}.txt"
        size = path.stat().st_size if path.exists() else 0  # earlier dumps stay in the file
        paths[rank] = (path, size)
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            pass
    stacks: dict[str, str] = {}
    linecache.checkcache()  # a script edited since an earlier dump is read again
    # Every rank's dump rides in one message to the coordinator, which has a size limit.
    keep = max(2_000, min(STACK_KEEP_CHARS, STACKS_TOTAL_CHARS // max(1, len(pids))))
    deadline = time.monotonic() + wait_s
    while paths and time.monotonic() < deadline:
        for rank, (path, size) in list(paths.items()):
            if path.exists() and path.stat().st_size > size:
                time.sleep(0.05)  # let faulthandler finish writing this dump
                # Source lines from this node's files: a wait straight into C++ (Work.wait() of
                # an irecv) shows only the script's line, which says it waits.
                text = path.read_bytes()[size:].decode(errors="replace")
                stacks[str(rank)] = annotate_sources(text, linecache.getline)[-keep:]
                del paths[rank]
        time.sleep(0.02)
    stacks.update({str(rank): "" for rank in paths})
    return stacks


def keep_dumps(stacks: dict[str, str], directory: str | None) -> None:
    """Write each rank's dump to ``directory/stacks/rank<N>.txt`` (the attempt's log directory):
    the verdict quotes one frame of each, and the dumps where the agent took them go with its
    work directory; a hang is often debugged after the processes are gone (acceptance 23C F2)."""
    if directory is None or not any(stacks.values()):
        return
    try:
        os.makedirs(os.path.join(directory, "stacks"), exist_ok=True)
        for rank, text in stacks.items():
            if text:
                Path(directory, "stacks", f"rank{rank}.txt").write_text(text, encoding="utf-8")
    except OSError:  # a full or read-only log directory: the verdict still goes out
        pass
