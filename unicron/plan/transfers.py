"""Nearest principle: where every rank of the new layout takes its state from.

A job's training state is cut into ``model_parallel`` shards; rank r holds shard
r % model_parallel, ranks numbered over the job's nodes in order, ``gpus`` ranks per node.
After a plan, each rank of a changed or hit job needs its shard. Copies live on the old
layout's surviving nodes, on the holders of in-memory snapshots (``snapshots``: holder ->
nodes it has copies of) and, always, in remote storage. For every (node, shard) the copy that
would finish first given the links already loaded by earlier choices is fetched once; the other
ranks on that node needing the same shard copy it inside the node. Estimated times are the
bytes crossing each link divided by its bandwidth, taking the most loaded link on the path
(links are shared fairly, every transfer starts at once).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx
import numpy as np

from unicron.plan.model import Job, PlanInput
from unicron.plan.solver import Plan
from unicron.plan.topology import SPINE, STORAGE, cluster_graph, link_gbps, node_vertex


@dataclass(frozen=True)
class Transfer:
    job: str
    rank: int
    node: str
    shard: int
    source: str  # node name, or "storage"
    kind: str  # in-place, same-node, same-rack, other-rack, storage
    bytes: int
    est_s: float

    def to_dict(self) -> dict[str, object]:
        return dict(vars(self))


def _ranks(nodes: tuple[str, ...], gpus: dict[str, int]) -> list[tuple[int, str, int]]:
    """(rank, node, local_rank) over the nodes in order."""
    out, rank = [], 0
    for name in nodes:
        for local in range(gpus[name]):
            out.append((rank, name, local))
            rank += 1
    return out


def _copies(job: Job, failed: set[str], gpus: dict[str, int]) -> dict[int, set[str]]:
    """Healthy nodes that hold each shard in memory: old survivors and snapshot holders."""
    shards_on: dict[str, set[int]] = defaultdict(set)
    for rank, name, _ in _ranks(job.nodes, gpus):
        shards_on[name].add(rank % job.model_parallel)
    holders: dict[int, set[str]] = defaultdict(set)
    for name in job.nodes:
        if name not in failed:
            for shard in shards_on[name]:
                holders[shard].add(name)
    for holder, held in job.snapshots.items():
        if holder in failed:
            continue
        for name in held:
            for shard in shards_on[name]:
                holders[shard].add(holder)
    return holders


class _Fabric:
    """Bytes already scheduled on every directed link of the rack tree, links numbered.

    Routes in the tree have a fixed shape (node -> rack -> spine -> rack -> node, storage ->
    spine -> rack -> node), so a route is a tuple of link numbers built without a graph walk and
    the loads and bandwidths of every rack's candidate are gathered with numpy at once: walking
    routes and graph attributes per candidate per fetch took 12 s at 2,048 nodes.
    """

    def __init__(self, inp: PlanInput, graph: nx.Graph) -> None:
        self.node = {n.name: i for i, n in enumerate(inp.nodes)}
        racks = list(dict.fromkeys(n.rack for n in inp.nodes))
        self.rack = {r: i for i, r in enumerate(racks)}
        self.rack_of = [self.rack[n.rack] for n in inp.nodes]
        # node number -> its place in name order: ties between sources go to the smaller name
        self.name_rank = np.empty(len(inp.nodes), dtype=np.int64)
        self.name_rank[[self.node[name] for name in sorted(self.node)]] = np.arange(len(inp.nodes))
        gbps: list[float] = []
        for n in inp.nodes:  # node i: uplink 3i, downlink 3i + 1, copies inside it 3i + 2
            vertex, switch = node_vertex(n.name), ("rack", n.rack)
            gbps += [link_gbps(graph, (vertex, switch)), link_gbps(graph, (switch, vertex)),
                     link_gbps(graph, (vertex, vertex))]
        self.rack_base = len(gbps)
        for r in racks:  # rack k: to the spine rack_base + 2k, from it rack_base + 2k + 1
            gbps += [link_gbps(graph, (("rack", r), SPINE)), link_gbps(graph, (SPINE, ("rack", r)))]
        self.storage = len(gbps)
        gbps.append(link_gbps(graph, (STORAGE, SPINE)))
        # Bit rates as the per-link formula computed them (gbps * 1e9), so estimates are unchanged.
        # Loads are kept twice: a list for one link at a time (numpy scalars are slow), an array
        # for gathering every candidate rack's links at once.
        self.bps = [g * 1e9 for g in gbps]
        self.bps_v = np.array(self.bps)
        self.load = [0.0] * len(gbps)
        self.load_v = np.zeros(len(gbps))

    def up(self, node: int) -> int:
        return 3 * node

    def down(self, node: int) -> int:
        return 3 * node + 1

    def local(self, node: int) -> int:
        return 3 * node + 2

    def rack_up(self, rack: int) -> int:
        return self.rack_base + 2 * rack

    def rack_down(self, rack: int) -> int:
        return self.rack_base + 2 * rack + 1

    def path(self, src: int | None, dst: int) -> tuple[int, ...]:
        """Links from node ``src`` (None: storage) to node ``dst``; a copy inside dst if equal."""
        r_dst = self.rack_of[dst]
        if src is None:
            return (self.storage, self.rack_down(r_dst), self.down(dst))
        if src == dst:
            return (self.local(dst),)
        if self.rack_of[src] == r_dst:
            return (self.up(src), self.down(dst))
        return (self.up(src), self.rack_up(self.rack_of[src]), self.rack_down(r_dst), self.down(dst))

    def time_s(self, link: int, extra_bytes: float) -> float:
        return (self.load[link] + extra_bytes) * 8 / self.bps[link]

    def add(self, path: tuple[int, ...], nbytes: float) -> None:
        for i in path:
            self.load[i] += nbytes
            self.load_v[i] = self.load[i]


class _Sources:
    """One job's in-memory copies: per shard, the racks holding one and, in each rack, the holder
    whose own uplink is least loaded (ties: name). Routes from one rack differ only in that first
    link, so no other holder of the rack can be a better source. Only a holder's own sends load
    its uplink, so a lazy heap per rack keeps each pick current in O(log holders) per send, where
    rescanning every holder per fetch was quadratic in the job's size. Shards held by the same
    nodes (all of a node's shards, usually) share one set of heaps, so a send updates one.
    """

    def __init__(self, holders: dict[int, set[str]], fabric: _Fabric) -> None:
        self.fabric = fabric
        groups: dict[frozenset[str], int] = {}
        self.group = {shard: groups.setdefault(frozenset(names), len(groups)) for shard, names in holders.items()}
        self.pick: list[list[int]] = []  # group -> each rack's pick (node number), racks in order
        self.links: list[np.ndarray] = []  # group -> the picks' uplinks, then those racks' uplinks
        self.slot: list[dict[int, int]] = []  # group -> rack number -> index in the two above
        self.heaps: dict[tuple[int, int], list[tuple[float, int, int]]] = {}  # (uplink load, name rank, node)
        self.held: dict[int, list[int]] = defaultdict(list)  # node -> groups it is in
        for names, group in groups.items():
            by_rack: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
            for name in names:
                i = fabric.node[name]
                by_rack[fabric.rack_of[i]].append((fabric.load[fabric.up(i)], int(fabric.name_rank[i]), i))
                self.held[i].append(group)
            racks = sorted(by_rack)
            for r in racks:
                heapq.heapify(by_rack[r])
                self.heaps[group, r] = by_rack[r]
            self.pick.append([by_rack[r][0][2] for r in racks])
            self.links.append(np.array([fabric.up(by_rack[r][0][2]) for r in racks] + [fabric.rack_up(r) for r in racks],
                                       dtype=np.int64))
            self.slot.append({r: k for k, r in enumerate(racks)})

    def sent(self, node: int) -> None:
        """``node``'s uplink now carries more: re-pick its rack's holder wherever it was the pick."""
        fabric, rack = self.fabric, self.fabric.rack_of[node]
        for group in self.held.get(node, ()):
            pick, slot = self.pick[group], self.slot[group][rack]
            if pick[slot] != node:  # still not the least loaded: its stale entry is fixed when on top
                continue
            heap = self.heaps[group, rack]
            # Loads only grow, so an entry whose recorded load is current is the true minimum.
            while (load := fabric.load[3 * heap[0][2]]) != heap[0][0]:  # 3 * node: its uplink (_Fabric.up)
                heapq.heapreplace(heap, (load, heap[0][1], heap[0][2]))
            pick[slot] = heap[0][2]
            self.links[group][slot] = 3 * pick[slot]

    def nearest(self, shard: int, dst: int, nbytes: float) -> int | None:
        """The source (node number, None: storage) whose copy to ``dst`` finishes first given the
        loads so far; ties go to the nearer kind, then to the smaller source name."""
        f = self.fabric
        last = f.time_s(f.down(dst), nbytes)  # rack -> dst: on every route
        into_rack = max(f.time_s(f.rack_down(f.rack_of[dst]), nbytes), last)
        storage = max(f.time_s(f.storage, nbytes), into_rack)
        group = self.group.get(shard)
        if group is None:
            return None
        pick, links = self.pick[group], self.links[group]
        times = (f.load_v[links] + nbytes) * 8 / f.bps_v[links]
        finish = np.maximum(times[:len(pick)], times[len(pick):])  # pick's uplink, rack's uplink,
        np.maximum(finish, into_rack, out=finish)  # then spine -> dst's rack -> dst
        same = self.slot[group].get(f.rack_of[dst])
        if same is not None:  # from dst's own rack: the pick's uplink, then rack -> dst
            finish[same] = max(f.time_s(f.up(pick[same]), nbytes), last)
        first = finish.min()
        if storage < first:
            return None
        if same is not None and finish[same] == first:
            return pick[same]
        tied = links[:len(pick)][finish == first] // 3  # the tied picks' node numbers (see _Fabric.up)
        return int(tied[np.argmin(f.name_rank[tied])])


def transfer_plan(inp: PlanInput, result: Plan, graph: nx.Graph | None = None) -> list[Transfer]:
    """One entry per rank of every job that changed or was hit and had state before.

    ``graph`` must have cluster_graph's shape (nodes, racks, one spine, storage); only its
    bandwidths are read.
    """
    # A huge state on a thin link overflows to inf: fine (float arithmetic does the same), no warning.
    with np.errstate(over="ignore"):
        return _transfer_plan(inp, result, graph if graph is not None else cluster_graph(inp))


def _transfer_plan(inp: PlanInput, result: Plan, graph: nx.Graph) -> list[Transfer]:
    fabric = _Fabric(inp, graph)
    failed = set(inp.failed)
    gpus = {n.name: n.gpus for n in inp.nodes}
    jobs = {j.name: j for j in inp.jobs}
    chosen: list[tuple[str, int, str, int, str, str, float, tuple[int, ...]]] = []
    for decision in result.decisions:
        job = jobs[decision.name]
        if not (decision.changed or decision.hit) or not job.nodes or not decision.after:
            continue
        holders = _copies(job, failed, gpus)
        sources = _Sources(holders, fabric)
        old_slot = {(name, local): rank % job.model_parallel for rank, name, local in _ranks(job.nodes, gpus)}
        nbytes = job.state_gb * 1e9 / job.model_parallel
        fetched: set[tuple[str, int]] = set()
        for rank, name, local in _ranks(decision.after, gpus):
            shard = rank % job.model_parallel
            if name not in failed and old_slot.get((name, local)) == shard:
                chosen.append((job.name, rank, name, shard, name, "in-place", 0.0, ()))
                continue
            dst = fabric.node[name]
            if (name, shard) in fetched or name in holders.get(shard, ()):
                path = fabric.path(dst, dst)  # fan out inside the node from the rank that has it
                fabric.add(path, nbytes)
                chosen.append((job.name, rank, name, shard, name, "same-node", nbytes, path))
                continue
            src = sources.nearest(shard, dst, nbytes)
            path = fabric.path(src, dst)
            fabric.add(path, nbytes)
            fetched.add((name, shard))
            if src is None:
                chosen.append((job.name, rank, name, shard, "storage", "storage", nbytes, path))
                continue
            sources.sent(src)
            kind = "same-rack" if fabric.rack_of[src] == fabric.rack_of[dst] else "other-rack"
            chosen.append((job.name, rank, name, shard, inp.nodes[src].name, kind, nbytes, path))
    return [Transfer(job=job_name, rank=rank, node=name, shard=shard, source=label, kind=kind, bytes=int(nbytes),
                     est_s=max((fabric.time_s(i, 0.0) for i in path), default=0.0))
            for job_name, rank, name, shard, label, kind, nbytes, path in chosen]


@dataclass
class JobTransfers:
    ranks: int = 0
    bytes: int = 0  # moved, in-place ranks excluded
    est_s: float = 0.0  # slowest rank
    by_kind: dict[str, int] = field(default_factory=dict)


def transfer_summary(transfers: list[Transfer]) -> dict[str, JobTransfers]:
    """Per job: ranks, bytes moved, estimated seconds and how many ranks each kind of source served."""
    out: dict[str, JobTransfers] = {}
    for t in transfers:
        entry = out.setdefault(t.job, JobTransfers())
        entry.ranks += 1
        entry.bytes += 0 if t.kind == "in-place" else t.bytes
        entry.est_s = max(entry.est_s, t.est_s)
        entry.by_kind[t.kind] = entry.by_kind.get(t.kind, 0) + 1
    return out
