"""The agent's side of membership: joining, being fenced, joining again (pure: clock passed in).

An agent joins by sending ``join`` every ``JOIN_RETRY_S`` until the coordinator welcomes it or
``join_timeout_s`` passes. Once a member, it may be fenced: it was silent past the heartbeat
timeout (a stall, a VM pause, a partition), the job went on without it, and its heartbeats are
refused with ``fenced``. It then joins again as torchrun's rendezvous re-admits a node back from
a stall, telling the coordinator the attempt it was lost from and the snapshots it kept, so the
job can re-form with it and restore every rank from memory. Or its coordinator restarted and
lost the job (``unknown_job``): it joins again with a ``Resume`` of the attempt its workers run,
which train on (``unicron.coord.resume``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unicron.agent.settings import AgentSettings
from unicron.coord.resume import MAX_FAULTS
from unicron.errors import RendezvousError

JOIN_RETRY_S = 1.0
QUIET_NOTICE_S = 10.0  # no answer this long (or half the join timeout, if shorter): say so, once
# The coordinator's stop timeout beyond the grace period, twice (a rank that raised is waited for
# first, up to the grace: unicron.agent.terminate), for the stack dumps.
STACK_STOP_MARGIN_S = 10.0


class Refusal(enum.Enum):
    FENCED = "fenced"  # a member no more: stop the workers and join again
    STALE = "stale"  # the answer to a heartbeat sent before the re-join: the join's answer decides
    WAIT = "wait"  # no place yet (the job is full): keep asking until the join timeout
    UNKNOWN = "unknown"  # the coordinator does not know the job (it restarted): resume it


@dataclass(frozen=True)
class Rejoin:
    """What a fenced agent tells the coordinator when it joins again."""

    attempt: int | None
    snapshots: dict[str, list[int]]
    snapshot_bytes: dict[str, int]

    def fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"snapshots": self.snapshots, "snapshot_bytes": self.snapshot_bytes}
        if self.attempt is not None:
            out["attempt"] = self.attempt
        return out


@dataclass(frozen=True)
class Resume:
    """What a member tells a coordinator that lost the job (``unicron.coord.resume``): made
    again for every join sent, since the workers train on meanwhile."""

    body: Callable[[], dict[str, Any]]

    def fields(self) -> dict[str, Any]:
        return self.body()


def resume_fields(assign: dict[str, Any] | None, *, epoch: int, state: str, faults: list[dict[str, Any]],
                  snapshots: dict[str, list[int]], snapshot_bytes: dict[str, int],
                  started: bool = True, store_untouched: bool = False) -> dict[str, Any]:
    """The ``join`` fields that resume the attempt ``assign`` gave this node, with its workers
    ``state`` (running, finished, stopped), whether all are past ``init_process_group``
    (``started``) or none has called it yet (``store_untouched``: the attempt's store, on the
    assign's ``master_port``, may be opened again empty), and the ``faults`` it reported; none
    before any assign (the node joins as at the start)."""
    if assign is None:
        return {}
    return {"resume": {"attempt": assign["attempt"], "nodes": assign["nodes"],
                       "local_world_sizes": assign["local_world_sizes"], "restarts_used": assign["restarts_used"],
                       "epoch": epoch, "state": state, "faults": faults[-MAX_FAULTS:],
                       "snapshots": snapshots, "snapshot_bytes": snapshot_bytes, "started": started,
                       "store_untouched": store_untouched,
                       **{k: assign[k] for k in ("started_at", "restarts", "master_addr", "master_port") if k in assign}}}


class JoinState:
    def __init__(self, endpoint: str, join_timeout_s: float, now: float, *, gone_after_s: float = 15.0) -> None:
        self.endpoint = endpoint
        # A coordinator that answered (the job is full: wait) and then says nothing this long is
        # gone: the job ended, or it died. It answers every join at once while it lives.
        self.gone_after_s = gone_after_s
        self.heard_at: float | None = None
        self.join_timeout_s = join_timeout_s
        self.full_timeout_s = join_timeout_s  # the first join's: a cut-off node waits as long (see fenced)
        self.cut_off: str | None = None  # why this node joins again after losing the coordinator
        self.welcomed = False
        self.started = now
        self.last_sent: float | None = None
        self.rejoin: Rejoin | Resume | None = None
        self.noticed = False
        self.refused: str | None = None  # why the last join was turned away, while it waits for a place

    def quiet_notice(self, now: float) -> str | None:
        """Once, when a first join has gone unanswered for a while: what to tell the user. The
        wait goes on (the coordinator's node may start later), but a coordinator that drops
        this node's messages (another secret) would otherwise keep it silent for the whole
        join timeout."""
        after = min(QUIET_NOTICE_S, self.join_timeout_s / 2)
        if self.welcomed or self.noticed or self.rejoin is not None or self.refused is not None \
                or now - self.started < after:
            return None
        self.noticed = True
        return (f"no answer yet from the coordinator at {self.endpoint} after {after:g} s; still trying for up "
                f"to {self.join_timeout_s:g} s (is it running, with this node's UNICRON_SECRET? it drops, "
                "unanswered, what is signed with another)")

    def join_due(self, now: float) -> bool:
        """Whether a join should go out now; raises once the join has waited too long."""
        if self.welcomed:
            return False
        if self.refused is not None and self.heard_at is not None and now - self.heard_at > self.gone_after_s:
            raise RendezvousError(f"the coordinator at {self.endpoint} stopped answering while this node waited "
                                  f"for a place ({self.refused}): no answer for {self.gone_after_s:g} s (the job "
                                  "ended, or its coordinator is gone)")
        if self.last_sent is not None and now - self.last_sent < JOIN_RETRY_S:
            return False
        if now - self.started > self.join_timeout_s:
            if self.refused is not None:
                raise RendezvousError(f"the coordinator refused this node for {self.join_timeout_s:g} s: "
                                      f"{self.refused}")
            if self.cut_off is not None:
                raise RendezvousError(f"{self.cut_off}, and it did not answer again within {self.join_timeout_s:g} s")
            raise RendezvousError(f"no coordinator answered at {self.endpoint} within {self.join_timeout_s:g} s "
                                  "(a coordinator drops, unanswered, what is signed with another UNICRON_SECRET)")
        self.last_sent = now
        return True

    def heard(self, now: float) -> None:
        """Some message of the coordinator came."""
        self.heard_at = now

    def on_welcome(self) -> Rejoin | Resume | None:
        """Now a member; returns the re-join this ends, if it was one."""
        ended, self.welcomed, self.rejoin, self.refused, self.cut_off = self.rejoin, True, None, None, None
        return ended

    def on_reject(self, body: dict[str, Any]) -> Refusal:
        """A refusal of a join that can pass (the job is full now: a member may be lost soon, as
        when a crashed node's replacement starts before the crash is noticed) is waited out;
        any other (the job is over, or of another shape) ends the agent."""
        for flag, refusal in (("fenced", Refusal.FENCED), ("unknown_job", Refusal.UNKNOWN)):
            if body.get(flag) is True:
                if self.welcomed:
                    return refusal
                if self.rejoin is not None:
                    return Refusal.STALE
        if body.get("wait") is True and not self.welcomed:
            # A coordinator that answers: the short limit of a re-join (``fenced``) is for one
            # that does not. A full job is waited out up to the join timeout, as at the start
            # (acceptance 29B F3: a fenced replacement refused as full gave up after 15 s);
            # one that stops answering meanwhile is given up on after ``gone_after_s``.
            self.join_timeout_s = self.full_timeout_s
            return Refusal.WAIT
        raise RendezvousError(f"the coordinator refused this node: {body['reason']}")

    def waiting_notice(self, reason: str) -> str | None:
        """What to tell the user when a join is turned away for now: once per distinct reason."""
        if reason == self.refused:
            return None
        self.refused = reason
        return (f"the coordinator has no place for this node yet ({reason}); asking again every "
                f"{JOIN_RETRY_S:g} s, for up to {self.join_timeout_s:g} s")

    def fenced(self, rejoin: Rejoin | Resume, now: float, timeout_s: float, *, cut_off: str | None = None) -> None:
        """Join again at once, carrying ``rejoin`` (fenced) or a ``Resume`` (the coordinator lost
        the job), for at most ``timeout_s``: the coordinator that just answered answers a join
        at once, so a long silence now means it is gone (it is not the start of a job, when
        nodes may come minutes apart). ``cut_off``: no coordinator answered (why, in words); it
        may be cut off by a partition that lasts, and waits for this node as long."""
        self.welcomed, self.rejoin, self.cut_off = False, rejoin, cut_off
        self.started, self.last_sent = now, None
        self.join_timeout_s = min(self.full_timeout_s, timeout_s)

    def join_fields(self) -> dict[str, Any]:
        return self.rejoin.fields() if self.rejoin is not None else {}


def join_body(s: AgentSettings, node_id: str, host: str, pid: int, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``join`` message of an agent with settings ``s``."""
    return {"node_id": node_id, "host": host, "nproc": s.nproc, "node_rank": s.node_rank,
            "pid": pid, "weight": s.weight, "min_nodes": s.min_nodes, "max_nodes": s.max_nodes,
            "max_restarts": s.max_restarts, "last_call_s": s.last_call_s,
            "heartbeat_timeout_s": s.heartbeat_timeout_s, "heartbeat_interval_s": s.heartbeat_interval_s,
            "join_timeout_s": s.join_timeout_s,
            "stop_timeout_s": 2 * s.grace_s + STACK_STOP_MARGIN_S, "hang": hang_settings(s),
            # its --inject: the job's first attempt injects every node's (a RANK is global)
            **({"inject": s.inject} if s.inject else {}), "role": s.role, **extra}


def hang_settings(s: AgentSettings) -> dict[str, float]:
    """The flags every node must share: each agent judges the whole job's hang by them."""
    return {"--hang-factor": s.hang_factor, "--hang-floor": s.hang_floor_s,
            "--hang-warmup-steps": s.hang_warmup_steps, "--hang-busy-factor": s.hang_busy_factor,
            "--hang-busy-floor": s.hang_busy_floor_s, "--first-step-timeout": s.first_step_timeout_s}
