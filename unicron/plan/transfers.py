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

from collections import defaultdict
from dataclasses import dataclass, field

import networkx as nx

from unicron.plan.model import Job, PlanInput
from unicron.plan.solver import JobDecision, Plan
from unicron.plan.topology import (
    STORAGE,
    Vertex,
    cluster_graph,
    distance_class,
    link_gbps,
    node_vertex,
    route,
)

Link = tuple[Vertex, Vertex]
KIND_ORDER = {"in-place": 0, "same-node": 1, "same-rack": 2, "other-rack": 3, "storage": 4}


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


class _Links:
    """Bytes already scheduled on every directed link, with routes and bandwidths cached."""

    def __init__(self, graph: nx.Graph) -> None:
        self.graph = graph
        self.load: dict[Link, float] = defaultdict(float)
        self._routes: dict[Link, list[Link]] = {}
        self._gbps: dict[Link, float] = {}

    def path(self, src: Vertex, dst: Vertex) -> list[Link]:
        key = (src, dst)
        if key not in self._routes:
            self._routes[key] = [(dst, dst)] if src == dst else route(self.graph, src, dst)
        return self._routes[key]

    def gbps(self, link: Link) -> float:
        if link not in self._gbps:
            self._gbps[link] = link_gbps(self.graph, link)
        return self._gbps[link]

    def finish_s(self, path: list[Link], extra_bytes: float) -> float:
        return max(((self.load[link] + extra_bytes) * 8 / (self.gbps(link) * 1e9) for link in path), default=0.0)

    def add(self, path: list[Link], nbytes: float) -> None:
        for link in path:
            self.load[link] += nbytes

    def candidates(self, holders: set[str], rack_of: dict[str, str]) -> list[Vertex]:
        """One holder per rack: the one whose own uplink is least loaded. Paths from holders
        in one rack differ only in that first link, so this loses no better choice."""
        best: dict[str, tuple[float, str]] = {}
        for name in holders:
            vertex = node_vertex(name)
            key = (self.load[(vertex, ("rack", rack_of[name]))], name)
            if rack_of[name] not in best or key < best[rack_of[name]]:
                best[rack_of[name]] = key
        return [node_vertex(name) for _, name in sorted(best.values(), key=lambda kv: kv[1])]


def transfer_plan(inp: PlanInput, result: Plan, graph: nx.Graph | None = None) -> list[Transfer]:
    """One entry per rank of every job that changed or was hit and had state before."""
    graph = graph if graph is not None else cluster_graph(inp)
    failed = set(inp.failed)
    gpus = {n.name: n.gpus for n in inp.nodes}
    rack_of = {n.name: n.rack for n in inp.nodes}
    jobs = {j.name: j for j in inp.jobs}
    links = _Links(graph)
    chosen: list[tuple[JobDecision, int, str, int, str, str, float, list[Link]]] = []
    for decision in result.decisions:
        job = jobs[decision.name]
        if not (decision.changed or decision.hit) or not job.nodes or not decision.after:
            continue
        holders = _copies(job, failed, gpus)
        old_slot = {(name, local): rank % job.model_parallel for rank, name, local in _ranks(job.nodes, gpus)}
        nbytes = job.state_gb * 1e9 / job.model_parallel
        fetched: dict[tuple[str, int], bool] = {}
        for rank, name, local in _ranks(decision.after, gpus):
            shard = rank % job.model_parallel
            dst = node_vertex(name)
            if name not in failed and old_slot.get((name, local)) == shard:
                chosen.append((decision, rank, name, shard, name, "in-place", 0.0, []))
                continue
            if (name, shard) in fetched or name in holders.get(shard, set()):
                path = links.path(dst, dst)  # fan out inside the node from the rank that has it
                chosen.append((decision, rank, name, shard, name, "same-node", nbytes, path))
                links.add(path, nbytes)
                continue
            near = links.candidates(holders.get(shard, set()) - {name}, rack_of)
            options = [(v, v[1]) for v in near] + [(STORAGE, "storage")]

            def cost(option: tuple[Vertex, str], dst: Vertex = dst, nbytes: float = nbytes) -> tuple[float, int, str]:
                src, label = option
                kind = distance_class(graph, src, dst)
                return (links.finish_s(links.path(src, dst), nbytes), KIND_ORDER[kind], label)

            src, label = min(options, key=cost)
            path = links.path(src, dst)
            links.add(path, nbytes)
            fetched[(name, shard)] = True
            chosen.append((decision, rank, name, shard, label, distance_class(graph, src, dst), nbytes, path))
    return [Transfer(job=d.name, rank=rank, node=name, shard=shard, source=label, kind=kind, bytes=int(nbytes),
                     est_s=links.finish_s(path, 0.0))
            for d, rank, name, shard, label, kind, nbytes, path in chosen]


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
