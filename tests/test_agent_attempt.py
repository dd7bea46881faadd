"""What a node's earlier attempts tell the next one's hang detector (``unicron.agent.attempt``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from unicron.agent.attempt import EarlierAttempts, group_spec


def assign(nodes: list[str], attempt: int = 1) -> dict[str, Any]:
    return {"attempt": attempt, "restart_count": attempt, "rank_offset": 0, "world_size": len(nodes),
            "node_rank": 0, "nnodes": len(nodes), "local_world_sizes": [1] * len(nodes), "master_addr": "h",
            "master_port": 1, "inject": False, "nodes": [[n, f"host-{n}"] for n in nodes], "restarts_used": 0}


def ended_group(spec: Any, startup_s: float) -> Any:
    stats = SimpleNamespace(startup_s=lambda: startup_s)
    return SimpleNamespace(spec=spec, hang=SimpleNamespace(stats=stats), ranks={})


def test_a_restart_on_the_same_nodes_keeps_the_startup_a_replaced_node_does_not() -> None:
    # A node replaced by a fresh launcher (a new node id, the same world size) starts cold: its
    # interpreter and imports are to come, and the survivors' ranks wait for it in the rendezvous.
    # Holding them to 5 x the warm start-up called that wait a hang.
    s = SimpleNamespace(rdzv_host="h", inject="")  # what group_spec reads of the settings
    earlier = EarlierAttempts()
    earlier.ended(ended_group(group_spec(assign(["a", "b"], 0), s), 4.0))  # type: ignore[arg-type]
    assert earlier.startup_hint(group_spec(assign(["a", "b"]), s)) == 4.0  # type: ignore[arg-type]
    assert earlier.startup_hint(group_spec(assign(["a", "c"]), s)) is None  # type: ignore[arg-type]
    assert earlier.startup_hint(group_spec(assign(["a", "b", "c"]), s)) is None  # type: ignore[arg-type]


def test_another_nodes_inject_for_a_rank_of_a_node_without_hooks_is_said_never_to_fire() -> None:
    """Acceptance 26A F3: node 1 ran --no-inject, node 0 gave --inject kill@2:5 (rank 2 on
    node 1): the merged fault could not fire there, and nothing said so."""
    from unicron.agent.attempt import inject_warnings

    s = SimpleNamespace(rdzv_host="h", inject="")
    body = dict(assign(["a", "b"], 0), node_rank=1, rank_offset=2, world_size=4, local_world_sizes=[2, 2],
                inject=True, inject_faults="kill@2:5;exit=3@0:4")
    spec = group_spec(body, s)  # type: ignore[arg-type]
    assert inject_warnings(spec, hooked=False) == [
        "--inject kill@2:5 never fires on rank(s) 2: this node starts its workers without unicron's hooks "
        "(--no-inject)"]
    assert inject_warnings(spec, hooked=True) == []
