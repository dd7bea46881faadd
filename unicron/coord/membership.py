"""Who is in the job: joins, node ranks, heartbeats, losses, and the membership epoch.

Pure: every method takes ``now``. The epoch grows whenever the set of active nodes
changes, so a message stamped with an older epoch comes from a fenced (stale) node.

What every heartbeat asks of it (how many nodes are active, the highest activity any reports,
whether one is silent) is kept up to date as nodes join, beat, leave and are lost, never
found by a scan of every node: a job of thousands of nodes gets thousands of heartbeats a
second. So a node's ``last_heartbeat`` and ``activity`` change only through this class.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

from unicron.coord.lastheard import LastHeard
from unicron.detect.activity import Activity


class NodeState(str, Enum):
    ACTIVE = "healthy"
    LOST = "lost"
    LEFT = "left"
    EXCLUDED = "excluded"  # left out by a reconfigure: it failed again in place


@dataclass
class NodeRecord:
    node_id: str
    host: str
    nproc: int
    requested_rank: int | None
    joined_at: float
    last_heartbeat: float  # set through Membership (its index of silences follows it)
    # When its last message really came: ``last_heartbeat`` moves on by silence the coordinator
    # excused (its own stall, or its own link cut: ``shift``); what ``unicron status`` shows.
    heard_at: float | None = None
    state: NodeState = NodeState.ACTIVE
    node_rank: int = -1
    workers: list[dict] = field(default_factory=list)
    health: dict = field(default_factory=dict)
    activity: Activity = Activity.IDLE  # what its ranks overdue for a step are doing (Membership.set_activity)


@dataclass(frozen=True)
class JoinResult:
    accepted: bool
    reason: str = ""  # why it was refused; for an accepted join, what was changed in it
    # No place now, but there may be one soon (a member about to be declared lost): the agent
    # keeps asking, as torchrun's extra nodes wait in the rendezvous, instead of ending.
    transient: bool = False


class Membership:
    """Tracks the nodes of one job.

    ``ready(now)`` follows torchrun's c10d rendezvous: start at once with ``max_nodes``;
    with at least ``min_nodes`` wait ``last_call_s`` more for late joiners.
    """

    def __init__(self, min_nodes: int, max_nodes: int, *, last_call_s: float, heartbeat_timeout_s: float) -> None:
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.last_call_s = last_call_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.nodes: dict[str, NodeRecord] = {}
        self.epoch = 0
        self._min_reached_at: float | None = None
        # Kept as nodes change, for the questions every heartbeat asks (see the module's doc):
        self._count = 0  # active nodes
        self._levels = [0] * len(Activity)  # active nodes reporting each activity
        self._heard = LastHeard()  # active nodes' last heartbeats, oldest first

    # ---- queries -------------------------------------------------------------------
    def count(self) -> int:
        """How many nodes are active."""
        return self._count

    def highest_activity(self) -> Activity:
        """The highest activity an active node reports (IDLE with none)."""
        return next((level for level in reversed(Activity) if self._levels[level]), Activity.IDLE)

    def oldest_heartbeat(self, skip: Collection[str] = ()) -> float | None:
        """The last heartbeat of the active node heard from longest ago, of those not in ``skip``."""
        return self._heard.oldest(skip)

    def active(self) -> list[NodeRecord]:
        """The active nodes in node-rank order (unranked ones last, by when they joined)."""
        return sorted(self.active_any_order(), key=_rank_order)

    def active_any_order(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state is NodeState.ACTIVE]

    def is_active(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.state is NodeState.ACTIVE

    def silent(self, now: float, after_s: float) -> list[NodeRecord]:
        """Active nodes not heard from for longer than ``after_s`` (in no set order)."""
        return [self.nodes[key] for key in self._heard.silent(now, after_s)]

    def ready(self, now: float) -> bool:
        count = self._count
        if count >= self.max_nodes:
            return True
        if count >= self.min_nodes and self._min_reached_at is not None:
            return now - self._min_reached_at >= self.last_call_s
        return False

    # ---- changes -------------------------------------------------------------------
    def join(self, node_id: str, host: str, nproc: int, requested_rank: int | None, now: float) -> JoinResult:
        existing = self.nodes.get(node_id)
        if existing is not None and existing.state is NodeState.ACTIVE:
            self._heard_from(existing, now)  # a re-sent join (the agent retries until welcomed)
            return JoinResult(True)
        if self._count >= self.max_nodes:
            return JoinResult(False, f"job is full: {self.max_nodes} node(s) already joined", transient=True)
        if requested_rank is not None:
            if requested_rank >= self.max_nodes:
                return JoinResult(False, f"--node-rank {requested_rank} is not below --nnodes {self.max_nodes}")
        note = ""
        if requested_rank is not None:
            taken = sorted((n for n in self.active_any_order() if n.requested_rank == requested_rank),
                           key=_rank_order)
            if taken:
                # Two nodes given one --node-rank (a copied command line): the job has room, so
                # this one takes a free rank, as torchrun's c10d rendezvous ignores the flag;
                # refusing it would leave both waiting for the other until the join timeout.
                note = (f"--node-rank {requested_rank} is already taken by {taken[0].host}: node {host} gets "
                        "a free node rank (give each node its own --node-rank)")
                requested_rank = None
        record = NodeRecord(node_id, host, nproc, requested_rank, now, now)
        if existing is not None:
            # A fenced node back (same agent): it asks for its old place, so the ranks it holds
            # snapshots of stay with it, unless another node took that place meanwhile.
            record.node_rank = existing.node_rank
        self._add(record)
        self.epoch += 1
        if self._min_reached_at is None and self._count >= self.min_nodes:
            self._min_reached_at = now
        return JoinResult(True, note)

    def adopt(self, nodes: list[tuple[str, str, int]], epoch: int, now: float) -> None:
        """Take back the nodes of a running attempt, each in its node rank (a restarted
        coordinator: ``unicron.coord.resume``); the epoch goes on from the one they knew."""
        for rank, (node_id, host, nproc) in enumerate(nodes):
            if not self.is_active(node_id):
                self._add(NodeRecord(node_id, host, nproc, None, now, now, node_rank=rank))
        self.epoch = max(self.epoch + 1, epoch)
        if self._min_reached_at is None and self._count >= self.min_nodes:
            self._min_reached_at = now

    def heartbeat(self, node_id: str, now: float, workers: list[dict] | None = None,
                  health: dict | None = None) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.ACTIVE:
            return False
        self._heard_from(node, now)
        if workers is not None:
            node.workers = workers
        if health is not None:
            node.health = health
        return True

    def expire(self, now: float, exempt: frozenset[str] = frozenset()) -> list[NodeRecord]:
        """Declare lost every active node silent for longer than the heartbeat timeout
        (except ``exempt`` ones, judged by another deadline), in node-rank order."""
        lost = sorted((n for n in self.silent(now, self.heartbeat_timeout_s) if n.node_id not in exempt),
                      key=_rank_order)
        for node in lost:
            self._remove(node, NodeState.LOST)
        return lost

    def leave(self, node_id: str, state: NodeState = NodeState.LEFT) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.ACTIVE:
            return None
        self._remove(node, state)
        return node

    def set_activity(self, node_id: str, level: Activity) -> None:
        """What an active node's ranks overdue for a step are doing, as its heartbeat says."""
        node = self.nodes[node_id]
        if node.state is NodeState.ACTIVE:
            self._levels[node.activity] -= 1
            self._levels[level] += 1
        node.activity = level

    def shift(self, gap_s: float) -> None:
        """Every active node's silence is ``gap_s`` shorter: the coordinator itself was not
        running that long, and heard nobody."""
        for node in self.active_any_order():
            node.last_heartbeat += gap_s
        self._heard.shift(gap_s)

    def _heard_from(self, node: NodeRecord, now: float) -> None:
        node.last_heartbeat = node.heard_at = now
        self._heard.set(node.node_id, now)

    def _add(self, record: NodeRecord) -> None:
        """``record`` (active) replaces what was known of its node (nothing, or an inactive one)."""
        self.nodes[record.node_id] = record
        if record.heard_at is None:
            record.heard_at = record.last_heartbeat
        self._count += 1
        self._levels[record.activity] += 1
        self._heard.set(record.node_id, record.last_heartbeat)

    def _remove(self, node: NodeRecord, state: NodeState) -> None:
        node.state = state
        self._count -= 1
        self._levels[node.activity] -= 1
        self._heard.discard(node.node_id)
        self.epoch += 1
        if self._count < self.min_nodes:
            self._min_reached_at = None

    def assign_ranks(self, first: Collection[str] = ()) -> list[NodeRecord]:
        """Give every active node a dense node rank, honouring requested ranks.

        Nodes keep their previous rank when it is still dense, so an unchanged job keeps
        its layout (and its snapshots line up with the same global ranks). Of the nodes left,
        those in ``first`` come first: the node whose launcher hosts the store gets node rank
        0 when no node asked for it, so rank 0 runs at ``MASTER_ADDR`` as under torchrun.
        """
        nodes = self.active()
        count = len(nodes)
        taken: dict[int, NodeRecord] = {}
        for node in nodes:
            if node.requested_rank is not None and node.requested_rank < count:
                taken[node.requested_rank] = node
        for node in nodes:
            if node in taken.values():
                continue
            if 0 <= node.node_rank < count and node.node_rank not in taken:
                taken[node.node_rank] = node
        free = iter(r for r in range(count) if r not in taken)
        for node in sorted((n for n in nodes if n not in taken.values()),
                           key=lambda n: (n.node_id not in first, n.joined_at)):
            taken[next(free)] = node
        for rank, node in taken.items():
            node.node_rank = rank
        return [taken[r] for r in range(count)]


def _rank_order(node: NodeRecord) -> tuple[int, float]:
    return (node.node_rank if node.node_rank >= 0 else 1 << 30, node.joined_at)
