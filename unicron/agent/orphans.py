"""Reap orphaned descendants that exit while the job runs.

The agent is a child subreaper: a worker's descendant whose parent died first (a double-forked
helper, a daemonised tool, a data loader of a worker that exited) becomes the agent's child.
``terminate_all`` reaps those when the workers stop, but one that exits on its own during a
long run would stay a zombie until then, holding a pid and a process-table slot each. The
agent calls ``reap_orphans`` every few seconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import psutil

from unicron.agent.proctree import children_of
from unicron.agent.warmspec import should_refill

if TYPE_CHECKING:
    from unicron.agent.workers import WorkerGroup
    from unicron.events import EventLog

REAP_EVERY_S = 2.0


def children_except(known: Collection[int]) -> list[int]:
    """This process's children whose pids are not in ``known``: what it adopted as a subreaper,
    once its own workers and zygote are in ``known``."""
    return [child for child in children_of(os.getpid()) if child not in known]


def reap_orphans(known: Collection[int]) -> list[int]:
    """Reap every exited child of this process whose pid is not in ``known``; return their pids.

    ``known`` must hold every child someone else waits for (``Popen`` objects of workers and the
    zygote, adopted warm workers): reaping one of those would lose its exit code.
    """
    reaped: list[int] = []
    for child in children_except(known):
        try:
            if psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
                continue
            pid, _ = os.waitpid(child, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            continue
        if pid:
            reaped.append(pid)
    return reaped


class Helpers:
    """The agent's own children that are not workers (the zygotes of its warm pool, its
    janitor), told apart from what it adopted as a subreaper: those go with the attempt that
    made them, the helpers stay for the agent's life."""

    def __init__(self, pool: Any, janitor: Any) -> None:
        self.pool, self.janitor = pool, janitor  # a WarmPool or None; a Janitor
        self.last_reap = 0.0

    def pids(self) -> set[int]:
        helpers = set(self.pool.pids() if self.pool is not None else ())
        return helpers | ({self.janitor.pid} if self.janitor.pid is not None else set())

    def adopted(self) -> list[int]:
        """Our children but our helpers: the workers, and what workers left behind that
        outlived its parent, such as a helper in a session of its own."""
        return children_except(self.pids())

    def chores(self, group: WorkerGroup | None, events: EventLog) -> None:
        """Between events: restart a zygote that died, once the attempt trains (not while its
        workers still start), and reap exited orphans."""
        if self.pool is not None and group is not None:
            progress = max((r.steps_in_attempt for r in group.ranks.values()), default=0)
            if should_refill(time.time(), group.started_at, progress):
                self.pool.refill()
        reaped = self.reap({r.proc.pid for r in group.ranks.values()} if group is not None else set(),
                           time.monotonic())
        if reaped:
            events.emit("orphans_reaped", pids=reaped)

    def reap(self, workers: Collection[int], now: float) -> list[int]:
        """Every ``REAP_EVERY_S`` (``now`` monotonic): reap exited orphans; return their pids."""
        if now - self.last_reap < REAP_EVERY_S:
            return []
        self.last_reap = now
        return reap_orphans(set(workers) | self.pids())
