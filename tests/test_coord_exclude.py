"""A reconfigure leaves out a node that failed again in place (pure core, fake clock): the
decision names it, the job goes on without it, and it cannot join again."""

from __future__ import annotations

from typing import Any

from test_coord_core import join, sends, spec

from unicron.coord.decide import DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.membership import NodeState
from unicron.coord.outbox import Emit, OpenStore
from unicron.coord.records import Phase

CUDA = "CUDA error: an illegal memory access was encountered"


def _crash(rank: int, attempt: int, ts: float) -> dict[str, Any]:
    return {"kind": "exception", "rank": rank, "ts": ts, "attempt": attempt, "error_type": "RuntimeError",
            "message": CUDA, "steps_completed": 0, "progress": 0}


def three_nodes(mn: int = 2, mx: int = 3, pinned: tuple[str, ...] = ("a",)) -> JobCore:
    core = JobCore(spec(mn, mx), DetectDecider(), now=0)
    core.pinned.update(pinned)
    for node in ("a", "b", "c"):
        core.on_join(node, join(node, nproc=1, node_rank="abc".index(node), mn=mn, mx=mx), 0)
    _start(core, 6)  # past the last call (5 s) when fewer than MAX joined
    return core


def _alive(core: JobCore, now: float) -> None:
    for node in core.members.active():
        core.on_heartbeat(node.node_id, {"workers": [], "health": {}}, now)


def _start(core: JobCore, now: float) -> dict[str, dict[str, Any]]:
    _alive(core, now)
    # (a decision to go on opens the next store itself, once its backoff allows)
    assert core.store_pending or any(isinstance(o, OpenStore) for o in core.tick(now))
    return sends(core.start_attempt("", 1234, now), "assign")


def _fail_on(core: JobCore, node: str, rank: int, now: float) -> list[Any]:
    """Rank ``rank`` on ``node`` raises a CUDA error before its first step; every node stops."""
    attempt = core.attempt
    assert attempt is not None
    _alive(core, now)
    outs = core.on_fault(node, {"attempt": attempt.number, "fault": _crash(rank, attempt.number, now)}, now)
    for n in attempt.nodes:
        outs += core.on_stopped(n, {"attempt": attempt.number, "snapshots": {}, "stacks": {}}, now + 0.5)
    return outs


def test_a_node_that_fails_again_after_a_restart_is_left_out_and_cannot_join_again() -> None:
    core = three_nodes()
    first = _fail_on(core, "c", 2, 7.0)
    assert [o.fields["action"] for o in first if isinstance(o, Emit) and o.kind == "decision"] == ["restart"]
    _start(core, 8.0)
    outs = _fail_on(core, "c", 2, 9.0)
    decision = next(o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision")
    assert decision["action"] == "reconfigure" and "goes on without node c" in decision["reason"], decision
    told = sends(outs, "reject")
    assert list(told) == ["c"] and told["c"]["reason"].startswith("left out of job job: "), told
    assert core.members.nodes["c"].state is NodeState.EXCLUDED
    assert any(isinstance(o, Emit) and o.kind == "node_excluded" and o.fields["node_id"] == "c" for o in outs)
    assigns = _start(core, 11.0)  # backoff: 1 s after the second failure in a row
    assert sorted(assigns) == ["a", "b"] and {a["world_size"] for a in assigns.values()} == {2}
    _alive(core, 12.0)
    again = core.on_join("c", join("c", nproc=1, mn=2, mx=3), 12.0)
    assert sends(again, "reject")["c"]["reason"] == told["c"]["reason"]
    assert core.phase is Phase.RUNNING and "c" not in core.attempt.nodes  # type: ignore[union-attr]


def test_the_coordinators_own_node_is_never_left_out() -> None:
    core = three_nodes(pinned=("c",))
    _fail_on(core, "c", 2, 7.0)
    _start(core, 8.0)
    outs = _fail_on(core, "c", 2, 9.0)
    decision = next(o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision")
    assert decision["action"] == "stop" and "node c hosts the job's coordinator" in decision["reason"], decision
    assert not sends(outs, "reject") and core.members.nodes["c"].state is NodeState.ACTIVE


def test_a_job_at_its_minimum_stops_and_says_so_rather_than_not_elastic() -> None:
    core = three_nodes(mn=3, mx=4)
    _fail_on(core, "b", 1, 7.0)
    _start(core, 8.0)
    outs = _fail_on(core, "b", 1, 9.0)
    decision = next(o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision")
    assert decision["action"] == "stop" and "cannot shrink below --nnodes MIN (3 nodes)" in decision["reason"]
    assert "not elastic" not in decision["reason"] and not sends(outs, "reject")


def test_only_a_failure_of_the_machine_leaves_its_node_out() -> None:
    """A hang, or a Python error of the script's own on one rank (a bad data shard), point at
    the script: the job stops as before rather than going on without that rank's work."""
    hang = {"kind": "hang", "rank": None, "ts": 2.0, "attempt": 0, "node_id": "a", "progress": 0,
            "message": "no step for 12.0 s"}
    stuck = "Thread 0x1 (most recent call first):\n  File \"train.py\", line 9 in <module>\n"
    waiting = ("Thread 0x1 (most recent call first):\n  File \"torch/distributed/distributed_c10d.py\", "
               "line 1 in all_reduce\n  File \"train.py\", line 7 in <module>\n")
    stacks = {0: waiting, 1: waiting, 2: stuck}
    kw: dict[str, Any] = {"max_restarts": 5, "active_nodes": 3, "min_nodes": 2, "max_nodes": 3,
                          "rank_nodes": {0: "a", 1: "b", 2: "c"}, "pinned": frozenset({"a"})}
    decider = DetectDecider()
    assert decider.decide([hang], stacks, 2.0, **kw).action == "restart"
    again = decider.decide([dict(hang, attempt=1, ts=9.0)], stacks, 9.0, **kw)
    assert again.action == "stop" and again.exclude == () and "points at the script" in again.reason, again
    shard = {"kind": "exception", "rank": 2, "ts": 2.0, "attempt": 0, "node_id": "c", "progress": 0,
             "steps_completed": 0, "error_type": "RuntimeError", "message": "Error(s) in loading state_dict: size mismatch"}
    data = DetectDecider()
    assert data.decide([shard], {}, 2.0, **kw).action == "restart"
    again = data.decide([dict(shard, attempt=1, ts=9.0)], {}, 9.0, **kw)
    assert again.action == "stop" and again.exclude == () and "points at the script" in again.reason, again


def test_a_failure_that_comes_from_every_node_leaves_no_node_out() -> None:
    """The same failure from ranks of two nodes (a CUDA error every GPU hits: a bad kernel of
    the script's) is no one node's fault: the job stops rather than shrinking on a guess."""
    core = three_nodes()
    for attempt_at in (7.0, 9.0):
        attempt = core.attempt
        assert attempt is not None
        _alive(core, attempt_at)
        bug = {"kind": "exception", "ts": attempt_at, "attempt": attempt.number, "error_type": "RuntimeError",
               "message": CUDA, "steps_completed": 0, "progress": 0}
        outs = core.on_fault("c", {"attempt": attempt.number, "fault": dict(bug, rank=2)}, attempt_at)
        outs += core.on_fault("b", {"attempt": attempt.number, "fault": dict(bug, rank=1)}, attempt_at)
        for n in attempt.nodes:
            outs += core.on_stopped(n, {"attempt": attempt.number, "snapshots": {}, "stacks": {}}, attempt_at + 0.5)
        if attempt_at == 7.0:
            _start(core, 8.0)
    decision = next(o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision")
    assert decision["action"] == "stop" and "does not point at one node" in decision["reason"], decision
    assert not sends(outs, "reject") and core.members.nodes["c"].state is NodeState.ACTIVE
