"""The cluster as a networkx graph: nodes under rack switches under one spine, plus storage.

Vertices are tuples so no user-chosen name can collide with a switch: ``("node", name)``,
``("rack", name)``, ``("spine",)`` and ``("storage",)``. Every link carries ``gbps`` (Gbit/s,
each direction) and every vertex but the spine its parent (``up``), so routes in this tree are
found by walking up to the common ancestor instead of a graph search per pair.
"""

from __future__ import annotations

from collections import Counter

import networkx as nx

from unicron.plan.model import PlanInput

Vertex = tuple[str, ...]
SPINE: Vertex = ("spine",)
STORAGE: Vertex = ("storage",)


def node_vertex(name: str) -> Vertex:
    return ("node", name)


def cluster_graph(inp: PlanInput) -> nx.Graph:
    net = inp.network
    failed = set(inp.failed)
    graph = nx.Graph()
    graph.add_node(SPINE, kind="spine")
    graph.add_node(STORAGE, kind="storage", up=SPINE)
    graph.add_edge(STORAGE, SPINE, gbps=net.storage_gbps)
    per_rack = Counter(n.rack for n in inp.nodes)
    for rack, count in per_rack.items():
        uplink = net.rack_uplink_gbps if net.rack_uplink_gbps is not None else count * net.node_gbps / 2
        graph.add_node(("rack", rack), kind="rack", up=SPINE)
        graph.add_edge(("rack", rack), SPINE, gbps=uplink)
    for node in inp.nodes:
        vertex = node_vertex(node.name)
        graph.add_node(vertex, kind="node", gpus=node.gpus, rack=node.rack, healthy=node.name not in failed,
                       up=("rack", node.rack), local_gbps=net.local_gbps)
        graph.add_edge(vertex, ("rack", node.rack), gbps=net.node_gbps)
    return graph


def _ancestors(graph: nx.Graph, vertex: Vertex) -> list[Vertex]:
    chain = [vertex]
    while "up" in graph.nodes[chain[-1]]:
        chain.append(graph.nodes[chain[-1]]["up"])
    return chain


def route(graph: nx.Graph, src: Vertex, dst: Vertex) -> list[tuple[Vertex, Vertex]]:
    """Directed links a transfer from src to dst crosses; [] when src == dst."""
    if src == dst:
        return []
    up_src, up_dst = _ancestors(graph, src), _ancestors(graph, dst)
    common = next(v for v in up_src if v in set(up_dst))
    climb = up_src[: up_src.index(common) + 1]
    descend = up_dst[: up_dst.index(common)][::-1]
    path = climb + descend
    return list(zip(path, path[1:], strict=False))


def link_gbps(graph: nx.Graph, link: tuple[Vertex, Vertex]) -> float:
    a, b = link
    if a == b:  # a copy inside one node
        return float(graph.nodes[a]["local_gbps"])
    return float(graph.edges[a, b]["gbps"])


def distance_class(graph: nx.Graph, src: Vertex, dst: Vertex) -> str:
    """How far a copy travels: same-node, same-rack, other-rack or storage."""
    if src == STORAGE:
        return "storage"
    if src == dst:
        return "same-node"
    if graph.nodes[src].get("rack") == graph.nodes[dst].get("rack"):
        return "same-rack"
    return "other-rack"
