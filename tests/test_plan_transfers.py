"""Nearest principle: own node, then same rack, then other racks, storage last; time estimates."""

from __future__ import annotations

from typing import Any

import pytest

from unicron.plan.model import PlanInput
from unicron.plan.solver import plan
from unicron.plan.topology import STORAGE, cluster_graph, node_vertex, route
from unicron.plan.transfers import transfer_plan, transfer_summary


def inp_with(jobs: list[dict[str, Any]], failed: list[str], racks: list[str], gpus: int = 2,
             network: dict[str, float] | None = None) -> PlanInput:
    data: dict[str, Any] = {
        "nodes": [{"name": f"n{i}", "gpus": gpus, "rack": r} for i, r in enumerate(racks)],
        "jobs": jobs, "failed": failed, "horizon_s": 3600, "transition_s": 60}
    if network:
        data["network"] = network
    return PlanInput.from_dict(data)


def by_rank(inp: PlanInput) -> dict[tuple[str, int], Any]:
    return {(t.job, t.rank): t for t in transfer_plan(inp, plan(inp))}


def test_routes_follow_the_tree() -> None:
    inp = inp_with([], [], ["r0", "r0", "r1"])
    graph = cluster_graph(inp)
    assert route(graph, node_vertex("n0"), node_vertex("n1")) == [
        (node_vertex("n0"), ("rack", "r0")), (("rack", "r0"), node_vertex("n1"))]
    assert len(route(graph, node_vertex("n0"), node_vertex("n2"))) == 4
    assert route(graph, STORAGE, node_vertex("n2"))[0] == (STORAGE, ("spine",))
    assert graph.edges[("rack", "r0"), ("spine",)]["gbps"] == 2 * 3200 / 2  # 2:1 oversubscribed default


def test_survivors_keep_their_state_in_place_and_replacement_copies_from_same_rack() -> None:
    # Pure data parallel (one shard): n1 fails, n2 (same rack as n0) replaces it.
    inp = inp_with([{"name": "a", "nodes": ["n0", "n1"], "throughput": {"2": 2}, "state_gb": 8}],
                   ["n1"], ["r0", "r0", "r0", "r1"])
    assert plan(inp).assignment["a"] == ["n0", "n2"]
    t = by_rank(inp)
    assert [(t["a", r].kind, t["a", r].est_s) for r in (0, 1)] == [("in-place", 0.0)] * 2
    assert (t["a", 2].kind, t["a", 2].source) == ("same-rack", "n0")
    assert (t["a", 3].kind, t["a", 3].source) == ("same-node", "n2")  # fetched once, fanned out in the node
    # 8 GB over n0's 3,200 Gb/s link: 0.02 s
    assert t["a", 2].est_s == pytest.approx(8e9 * 8 / 3200e9)


def test_snapshot_in_the_same_rack_beats_a_replica_in_another_rack() -> None:
    # Two shards (model parallel 2 on 2-GPU nodes): each node holds shards {0, 1}.
    jobs = [{"name": "a", "nodes": ["n0", "n1"], "throughput": {"2": 2}, "state_gb": 4, "model_parallel": 2,
             "snapshots": {"n3": ["n1"]}}]
    inp = inp_with(jobs, ["n1"], ["r0", "r1", "r2", "r2"])
    assert plan(inp).assignment["a"] == ["n0", "n2"]
    t = by_rank(inp)
    # n3 (rack r2, like n2) holds n1's snapshot: it beats n0's replica in r0.
    assert [(t["a", r].source, t["a", r].kind) for r in (2, 3)] == [("n3", "same-rack")] * 2


def test_storage_only_when_no_copy_survives() -> None:
    jobs = [{"name": "a", "nodes": ["n0"], "throughput": {"1": 1}, "state_gb": 1, "model_parallel": 1}]
    inp = inp_with(jobs, ["n0"], ["r0", "r0"], network={"storage_gbps": 10})
    t = by_rank(inp)
    assert [x.kind for x in (t["a", 0], t["a", 1])] == ["storage", "same-node"]
    assert t["a", 0].est_s == pytest.approx(1e9 * 8 / 10e9)


def test_contention_spreads_fetches_over_sources() -> None:
    # Two new nodes in r1 need the same shard; two holders in r0 and one in r1.
    jobs = [{"name": "a", "nodes": ["n0", "n1", "n2"], "throughput": {"3": 3, "5": 5}, "state_gb": 16}]
    inp = inp_with(jobs, [], ["r0", "r0", "r1", "r1", "r1"], gpus=1,
                   network={"node_gbps": 100, "rack_uplink_gbps": 1000})
    result = plan(inp)
    assert sorted(result.assignment["a"]) == ["n0", "n1", "n2", "n3", "n4"]
    moves = [t for t in transfer_plan(inp, result) if t.kind != "in-place"]
    assert {t.node for t in moves} == {"n3", "n4"}
    # Same rack first (n2), and not both from n2: its 100 Gb/s link would carry 32 GB.
    assert sorted(t.source for t in moves) in (["n0", "n2"], ["n1", "n2"])
    assert max(t.est_s for t in moves) == pytest.approx(16e9 * 8 / 100e9)
    summary = transfer_summary(transfer_plan(inp, result))["a"]
    assert summary.ranks == 5 and summary.bytes == 32_000_000_000


def test_unchanged_jobs_move_nothing() -> None:
    jobs = [{"name": "a", "nodes": ["n0"], "throughput": {"1": 1}, "state_gb": 5},
            {"name": "b", "nodes": ["n1"], "throughput": {"1": 1}, "state_gb": 5}]
    inp = inp_with(jobs, ["n1"], ["r0", "r0", "r0"])
    jobs_moved = {t.job for t in transfer_plan(inp, plan(inp))}
    assert jobs_moved == {"b"}
