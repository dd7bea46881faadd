"""Which in-memory snapshot a new attempt restores (pure).

Each agent holds its own ranks' snapshots in shared memory it owns, and says what it holds when
it stops an attempt, or when it re-joins after being fenced (its workers stopped, its memory
kept). A new attempt restores step S only if every rank's new node holds that rank's snapshot
of S, and the world size is unchanged: snapshots do not move between nodes, so a changed layout
means a fresh start from the script's own checkpoint, never ranks resuming from different steps.

Only what was said about the attempt that just stopped counts: snapshots older than that belong
to a line of training that a later attempt may already have left (an elastic job that went on
without a node, then grew back to it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NodeSnapshots:
    steps: dict[int, frozenset[int]]  # global rank -> steps with a complete snapshot on this node
    nbytes: dict[int, int]  # step -> bytes held for it over this node's ranks


@dataclass
class Holdings:
    """What every node said it holds after ``attempt`` (of ``world_size`` ranks) stopped."""

    attempt: int
    world_size: int
    nodes: dict[str, NodeSnapshots] = field(default_factory=dict)

    def add(self, node_id: str, body: Mapping[str, Any]) -> None:
        self.nodes[node_id] = parse_snapshots(body)

    def restorable_step(self, layout: Iterable[tuple[str, int, int]]) -> int | None:
        """The newest step every rank's node holds, for ``layout`` (node id, first global rank,
        rank count) of the next attempt; None when there is none or the world size changed."""
        layout = list(layout)
        if sum(count for _, _, count in layout) != self.world_size or self.world_size == 0:
            return None
        common: frozenset[int] | None = None
        for node_id, first, count in layout:
            held = self.nodes.get(node_id)
            for rank in range(first, first + count):
                steps = held.steps.get(rank, frozenset()) if held is not None else frozenset()
                common = steps if common is None else common & steps
        return max(common) if common else None

    def not_restored(self, layout: Iterable[tuple[str, int, int]]) -> str:
        """Why ``layout`` restores nothing though snapshots were kept ("" when none were, or
        when it restores): what the console says, so a fresh start is never silent."""
        layout = list(layout)
        newest = self._newest()
        if not newest or self.restorable_step(layout) is not None:
            return ""
        world = sum(count for _, _, count in layout)
        if world != self.world_size:
            why = f"the world size changed ({self.world_size} -> {world})"
        else:
            missing = [rank for node_id, first, count in layout for rank in range(first, first + count)
                       if not (self.nodes[node_id].steps.get(rank) if node_id in self.nodes else None)]
            why = self._missing(missing[0], layout) if missing else "no step is held for every rank"
        return f"the snapshots kept in memory ({newest}) cannot be restored: {why}"

    def _newest(self) -> str:
        """The newest snapshot kept, in words ("" when none): the newest step held by every rank
        that kept any (the one that would have been restored), and a newer one some ranks held.
        The newest step of any rank alone overstated what was lost (33B F2: "newest: step 100"
        where rank 0 never committed 100, and 99 was what a restore would have given)."""
        held: dict[int, frozenset[int]] = {}
        for node in self.nodes.values():
            for rank, steps in node.steps.items():
                held[rank] = held.get(rank, frozenset()) | steps
        top = max((s for steps in held.values() for s in steps), default=None)
        if top is None:
            return ""
        common = frozenset.intersection(*(steps for steps in held.values() if steps))
        if not common:
            return f"newest: step {top}, on some ranks only"
        if max(common) == top:
            return f"newest: step {top}"
        return f"newest held by every rank that kept one: step {max(common)}; step {top} by some only"

    def _missing(self, rank: int, layout: list[tuple[str, int, int]]) -> str:
        node_id = next(n for n, first, count in layout if first <= rank < first + count)
        if node_id not in self.nodes:
            return f"rank {rank}'s new node holds no snapshot of it"
        if any(n.steps.get(rank) for n in self.nodes.values()):
            return f"rank {rank} moved to a node that holds no snapshot of it"
        # Not "yet": a script may make its State on some ranks only, and then it never will; nor
        # only that: a State takes none before a DDP model's first rebuild (28C F1). The agent
        # does not know whether the script has a DDP: the DDP case is worded as one of the
        # possible ones, as a rank that died before its first commit is the usual one (31A F4).
        return (f"rank {rank} made no snapshot in that attempt (it stopped before its first commit, or made "
                "no State; with a DistributedDataParallel model, the first commit of a fresh start makes none)")

    def restored_bytes(self, step: int, node_ids: Iterable[str]) -> int:
        """Bytes of ``step`` held on ``node_ids`` (those of the new layout)."""
        return sum(self.nodes[n].nbytes.get(step, 0) for n in set(node_ids) if n in self.nodes)


def parse_snapshots(body: Mapping[str, Any]) -> NodeSnapshots:
    """``snapshots`` ({"rank": [steps]}) and ``snapshot_bytes`` ({"step": n}) of an agent's
    message; entries of another shape (a peer's garbage) are skipped, never raised on."""
    steps: dict[int, frozenset[int]] = {}
    raw = body.get("snapshots")
    for rank, values in (raw.items() if isinstance(raw, dict) else ()):
        if _is_count(rank) and isinstance(values, list):
            steps[int(rank)] = frozenset(int(s) for s in values if type(s) is int and s >= 0)
    nbytes: dict[int, int] = {}
    sizes = body.get("snapshot_bytes")
    for step, size in (sizes.items() if isinstance(sizes, dict) else ()):
        if _is_count(step) and type(size) is int and size >= 0:
            nbytes[int(step)] = size
    return NodeSnapshots(steps, nbytes)


def _is_count(text: Any) -> bool:
    return isinstance(text, str) and text.isascii() and text.isdigit()


def finished_ranks(stopped: Iterable[Mapping[str, Any]]) -> list[tuple[int, int | None]]:
    """(rank, its last step) of every rank the agents saw exit 0 before the stop; entries that
    are not that shape (a peer's garbage) are skipped."""
    out = []
    for body in stopped:
        for item in body.get("finished", ()):
            if not isinstance(item, dict):
                continue
            rank, step = item.get("rank"), item.get("step")
            if type(rank) is int and (step is None or type(step) is int):
                out.append((rank, step))
    return sorted(out)


def choose_restore(holdings: Holdings | None, nodes: list[tuple[str, int]]) -> tuple[int | None, str, int]:
    """For the next attempt's ``nodes`` (node id, rank count, in node-rank order): the step it
    restores from memory (None: none), why nothing is restored though snapshots were kept, and
    the bytes restored."""
    if holdings is None:
        return None, "", 0
    layout, first = [], 0
    for node_id, count in nodes:
        layout.append((node_id, first, count))
        first += count
    step = holdings.restorable_step(layout)
    nbytes = holdings.restored_bytes(step, [n for n, _ in nodes]) if step is not None else 0
    return step, holdings.not_restored(layout), nbytes
