"""The coordinator's records of a job (plain data, no behaviour): its phase, what it was
started with, and the attempt in flight. The state machine that moves them is
``unicron.coord.job``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from unicron.coord.progress import RankProgress


class Phase(str, Enum):
    """WAITING (for nodes, or a restart's backoff) -> RUNNING -> STOPPING -> RUNNING | DONE | FAILED."""

    WAITING = "waiting"
    RUNNING = "running"
    STOPPING = "restarting"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class JobSpec:
    """What the job was started with (the first node's flags; later nodes must agree)."""

    job_id: str
    min_nodes: int
    max_nodes: int
    max_restarts: int
    last_call_s: float = 30.0
    heartbeat_timeout_s: float = 3.0
    heartbeat_interval_s: float = 0.5
    join_timeout_s: float = 600.0
    stop_timeout_s: float = 40.0
    hang: dict[str, Any] = field(default_factory=dict)  # the hang flags (--hang-floor ...), by flag


@dataclass
class Attempt:
    """One start of every node's workers, until each node has stopped them or they finished."""

    number: int
    started_at: float
    nodes: list[str]  # node ids, in node-rank order
    world_size: int
    faults: list[dict[str, Any]] = field(default_factory=list)  # as reported, all kept for the root cause
    stopped: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> its `stopped` report
    finished: set[str] = field(default_factory=set)  # nodes whose workers all exited 0
    done: set[str] = field(default_factory=set)  # nodes with some rank past its last step (exited 0, closed)
    progress: RankProgress = field(default_factory=RankProgress)  # each rank's steps (uneven progress)
    stop_reason: str = ""
    stop_sent_at: float | None = None
    # A staged stop (``unicron.coord.stopping.stop_attempt``): the node whose rank raised is told
    # first, the others (``stop_body``) once it stopped.
    stop_waits_for: str | None = None
    stop_body: dict[str, Any] = field(default_factory=dict)
    scale_up: bool = False  # stopped to grow: a late joiner, not a failure
    planned: bool = False  # stopped for no fault of its own (its store gone with a coordinator): a re-form
    restore_step: int = 0  # the step its ranks restored (0: a fresh start)
    silence_ended_at: float | None = None  # a silent node of this attempt was heard again then
    node_set: frozenset[str] = field(init=False, repr=False, compare=False)  # ``nodes``, to ask without a scan

    def __post_init__(self) -> None:
        self.node_set = frozenset(self.nodes)

    @property
    def steps(self) -> dict[int, tuple[int, float]]:
        """rank -> (steps completed, when this coordinator first heard of that step)."""
        return self.progress.steps

    def heard_again(self, now: float) -> None:
        """A silent node of the attempt was heard again (see ``recovering``)."""
        self.silence_ended_at = now
        self.progress.heard_again(now, self.world_size)

    def recovering(self) -> bool:
        """A node of the attempt went silent (its link cut, or it stalled) and was heard again,
        and not every rank has stepped since. Its ranks' connections may still be catching up:
        TCP's retransmissions back off while a link is down, so an outage of a few seconds can
        take about as long again before a waiting collective gets its data."""
        return self.progress.recovering()

    def stacks(self) -> dict[int, str]:
        """Every rank's stack dump that came with the nodes' ``stopped`` reports."""
        return {int(r): s for body in self.stopped.values() for r, s in body.get("stacks", {}).items()}

    def note_steps(self, workers: Any, now: float) -> None:
        """Each rank's steps from a heartbeat's ``workers`` (malformed entries skipped)."""
        for w in workers if isinstance(workers, list) else []:
            rank, step = (w.get("rank"), w.get("step")) if isinstance(w, dict) else (None, None)
            if type(rank) is int and type(step) is int:
                self.progress.note(rank, step, now)
