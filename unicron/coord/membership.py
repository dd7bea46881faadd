"""Who is in the job: joins, node ranks, heartbeats, losses, and the membership epoch.

Pure: every method takes ``now``. The epoch grows whenever the set of active nodes
changes, so a message stamped with an older epoch comes from a fenced (stale) node.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import Enum

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
    last_heartbeat: float
    state: NodeState = NodeState.ACTIVE
    node_rank: int = -1
    workers: list[dict] = field(default_factory=list)
    health: dict = field(default_factory=dict)
    activity: Activity = Activity.IDLE  # what its ranks overdue for a step are doing


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

    # ---- queries -------------------------------------------------------------------
    def active(self) -> list[NodeRecord]:
        """The active nodes in node-rank order (unranked ones last, by when they joined)."""
        return sorted(self.active_any_order(), key=lambda n: (n.node_rank if n.node_rank >= 0 else 1 << 30, n.joined_at))

    def active_any_order(self) -> list[NodeRecord]:
        # What every heartbeat looks at (the job's activity, silent nodes): no sort of every
        # node per heartbeat, which a job of thousands of nodes pays thousands of times a second.
        return [n for n in self.nodes.values() if n.state is NodeState.ACTIVE]

    def is_active(self, node_id: str) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.state is NodeState.ACTIVE

    def silent(self, now: float, after_s: float) -> list[NodeRecord]:
        """Active nodes not heard from for longer than ``after_s``."""
        return [n for n in self.active_any_order() if now - n.last_heartbeat > after_s]

    def ready(self, now: float) -> bool:
        count = len(self.active_any_order())
        if count >= self.max_nodes:
            return True
        if count >= self.min_nodes and self._min_reached_at is not None:
            return now - self._min_reached_at >= self.last_call_s
        return False

    # ---- changes -------------------------------------------------------------------
    def join(self, node_id: str, host: str, nproc: int, requested_rank: int | None, now: float) -> JoinResult:
        existing = self.nodes.get(node_id)
        if existing is not None and existing.state is NodeState.ACTIVE:
            existing.last_heartbeat = now  # a re-sent join (the agent retries until welcomed)
            return JoinResult(True)
        if len(self.active()) >= self.max_nodes:
            return JoinResult(False, f"job is full: {self.max_nodes} node(s) already joined", transient=True)
        if requested_rank is not None:
            if requested_rank >= self.max_nodes:
                return JoinResult(False, f"--node-rank {requested_rank} is not below --nnodes {self.max_nodes}")
        note = ""
        if requested_rank is not None:
            taken = [n for n in self.active() if n.requested_rank == requested_rank]
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
        self.nodes[node_id] = record
        self.epoch += 1
        if self._min_reached_at is None and len(self.active()) >= self.min_nodes:
            self._min_reached_at = now
        return JoinResult(True, note)

    def adopt(self, nodes: list[tuple[str, str, int]], epoch: int, now: float) -> None:
        """Take back the nodes of a running attempt, each in its node rank (a restarted
        coordinator: ``unicron.coord.resume``); the epoch goes on from the one they knew."""
        for rank, (node_id, host, nproc) in enumerate(nodes):
            if not self.is_active(node_id):
                self.nodes[node_id] = NodeRecord(node_id, host, nproc, None, now, now, node_rank=rank)
        self.epoch = max(self.epoch + 1, epoch)
        if self._min_reached_at is None and len(self.active()) >= self.min_nodes:
            self._min_reached_at = now

    def heartbeat(self, node_id: str, now: float, workers: list[dict] | None = None,
                  health: dict | None = None) -> bool:
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.ACTIVE:
            return False
        node.last_heartbeat = now
        if workers is not None:
            node.workers = workers
        if health is not None:
            node.health = health
        return True

    def expire(self, now: float, exempt: frozenset[str] = frozenset()) -> list[NodeRecord]:
        """Declare lost every active node silent for longer than the heartbeat timeout
        (except ``exempt`` ones, judged by another deadline)."""
        lost = [n for n in self.active()
                if n.node_id not in exempt and now - n.last_heartbeat > self.heartbeat_timeout_s]
        for node in lost:
            self._remove(node, NodeState.LOST)
        return lost

    def leave(self, node_id: str, state: NodeState = NodeState.LEFT) -> NodeRecord | None:
        node = self.nodes.get(node_id)
        if node is None or node.state is not NodeState.ACTIVE:
            return None
        self._remove(node, state)
        return node

    def _remove(self, node: NodeRecord, state: NodeState) -> None:
        node.state = state
        self.epoch += 1
        if len(self.active()) < self.min_nodes:
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
