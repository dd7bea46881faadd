"""What the coordinator tells every agent about the whole job, so that each judges a hang by
the job and not by its own ranks alone (pure: state and time in, answers out).

- The job's activity: the highest any node reports; at least BUSY while a node of the running
  attempt is silent (its ranks may be what the others wait for), and after it is heard again
  until every rank has stepped (its connections may still be catching up); WORKING while a rank
  steps two or more steps ahead of another (an uneven end: it trains on alone).
- Whether the attempt is past its last step: some rank exited 0 or destroyed its process group
  (a node's ``done``, or all its workers ``finished``); the others' tails are never a hang.
- Whether a joining node agrees with the job's shape and hang settings.
"""

from __future__ import annotations

from typing import Any

from unicron.coord.membership import Membership
from unicron.coord.records import Attempt, JobSpec, Phase
from unicron.detect.activity import Activity


def running(phase: Phase, attempt: Attempt | None) -> Attempt | None:
    return attempt if phase is Phase.RUNNING else None


def past_last_step(phase: Phase, attempt: Attempt | None) -> bool:
    """Some rank of the running attempt exited 0 or destroyed its process group: no collective
    can join every rank again, so what the others do from now on (an upload, a final
    checkpoint, ``wandb.finish()``) is their tail, never a hang."""
    a = running(phase, attempt)
    return a is not None and bool(a.finished or a.done)


def silent_nodes(spec: JobSpec, members: Membership, phase: Phase, attempt: Attempt | None,
                 now: float) -> frozenset[str]:
    """Nodes of the running attempt that missed two heartbeats. Their ranks may be what the
    others wait for (a node stalled whole: a VM pause): until such a node is heard again or
    declared lost, the others hold their ranks to the longer busy threshold, so an idle hang
    verdict does not blame a rank that waits on it."""
    a = running(phase, attempt)
    if a is None:
        return frozenset()
    after = 2 * spec.heartbeat_interval_s
    # Not a node whose workers all finished: nobody's ranks wait on them.
    return frozenset(n.node_id for n in members.silent(now, after) if n.node_id in a.node_set
                     and n.node_id not in a.finished)


def job_activity(spec: JobSpec, members: Membership, phase: Phase, attempt: Attempt | None,
                 now: float | None = None) -> Activity:
    """The highest activity any node reports (IDLE with no node); given ``now``, at least BUSY
    while a node of the running attempt is silent, and WORKING while a rank trains on ahead of
    one that waits (within two heartbeat intervals of its last step).

    Asked twice per heartbeat: every part is kept as nodes and steps come (``Membership``,
    ``RankProgress``), none is a scan of the job's nodes or ranks."""
    level = members.highest_activity()
    if now is None:
        return level
    a = running(phase, attempt)
    if silent_nodes(spec, members, phase, attempt, now) or (a is not None and a.recovering()):
        level = max(level, Activity.BUSY)
    if a is not None and a.progress.uneven(now, 2 * spec.heartbeat_interval_s):
        level = Activity.WORKING
    return level


def join_mismatch(spec: JobSpec, body: dict[str, Any]) -> str | None:
    """Why a joining node cannot be part of this job as started (None: it can)."""
    if body["min_nodes"] != spec.min_nodes or body["max_nodes"] != spec.max_nodes:
        return (f"--nnodes mismatch: this node says {body['min_nodes']}:{body['max_nodes']}, "
                f"the job is {spec.min_nodes}:{spec.max_nodes}")
    if body["max_restarts"] != spec.max_restarts:  # one budget counts the whole job's restarts
        return (f"--max-restarts mismatch: this node says {body['max_restarts']}, the job's is "
                f"{spec.max_restarts} (restarts are counted job-wide: give every node the same)")
    theirs = body.get("hang") or {}
    differ = [f"{flag} {theirs.get(flag)!r}, the job's {value!r}" for flag, value in spec.hang.items()
              if theirs.get(flag) != value]
    if differ:  # each agent judges the whole job's hang by its own: a node alone with a longer floor is no use
        return "hang settings differ from the job's (give every node the same): this node has " + "; ".join(differ)
    return None


def next_tick_s(spec: JobSpec, members: Membership, phase: Phase, told_silent: frozenset[str], now: float,
                done: frozenset[str] = frozenset()) -> float:
    """How long the job core's ``tick`` has nothing to do unless a message comes first: 0 while
    waiting or stopping (their deadlines are short-lived: tick at the shell's pace), the first
    node's heartbeat deadline while running (or its silence to tell the others of, for nodes
    not ``told_silent`` yet), inf once the job ended. Nodes ``done`` (their workers all exited
    0) are judged by no heartbeat deadline."""
    if phase in (Phase.DONE, Phase.FAILED):
        return float("inf")
    if phase is not Phase.RUNNING:
        return 0.0
    deadlines = []
    oldest = members.oldest_heartbeat(skip=done)
    if oldest is not None:
        deadlines.append(oldest + members.heartbeat_timeout_s)
    untold = members.oldest_heartbeat(skip=told_silent | done)
    if untold is not None:
        deadlines.append(untold + 2 * spec.heartbeat_interval_s)
    # expire() wants silence longer than the timeout: a hair past the deadline, not on it.
    return max(0.0, min(deadlines, default=float("inf")) - now + 0.001)
