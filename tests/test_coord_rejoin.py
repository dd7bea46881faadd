"""A fenced node joining again, and which snapshot the next attempt restores: the coordinator's
pure core and ``unicron.coord.restore``, driven by hand with a fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from test_coord_core import RESTART, ScriptedDecider, join, sends, spec, started, two_nodes_running

from unicron.coord.decide import Decision, DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.membership import Membership
from unicron.coord.outbox import Emit, OpenStore
from unicron.coord.records import Phase
from unicron.coord.restore import Holdings, finished_ranks, parse_snapshots
from unicron.proto.schema import schema_errors

RECONFIGURE = Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")
HB: dict[str, Any] = {"workers": [], "health": {}}


def rejoin(node: str, attempt: int, snapshots: dict[str, list[int]], mn: int = 2, mx: int = 2) -> dict[str, Any]:
    return dict(join(node, mn=mn, mx=mx), attempt=attempt, snapshots=snapshots, snapshot_bytes={"7": 100})


def fixed_job_with_b_lost() -> JobCore:
    """A fixed 2-node job (a: ranks 0-1, b: ranks 2-3) whose node b went silent at 1 and was
    declared lost at 4.5; a stopped, keeping snapshots of steps 6 and 7."""
    core = JobCore(spec(), ScriptedDecider(RECONFIGURE, RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    assigns = started(core, 1)
    assert assigns["b"]["rank_offset"] == 2
    core.on_heartbeat("a", HB, 4)
    outs = core.tick(4.5)
    assert [o.kind for o in outs if isinstance(o, Emit) and o.kind == "node_lost"]
    core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [6, 7], "1": [6, 7]}, "stacks": {}}, 5)
    assert core.phase is Phase.WAITING and not core.members.is_active("b")
    return core


def test_a_fenced_nodes_heartbeat_is_refused_as_fenced() -> None:
    core = fixed_job_with_b_lost()
    refused = sends(core.on_heartbeat("b", HB, 6), "reject")["b"]
    assert refused["fenced"] is True and "declared lost" in refused["reason"]
    assert refused["lost"] is True  # this job wants it back: it joins again even if its workers finished
    assert schema_errors("reject", refused) is None
    stranger = sends(core.on_heartbeat("x", HB, 6), "reject")["x"]
    assert stranger["fenced"] is True and "lost" not in stranger  # a new coordinator's, say (acceptance 21B F3)


def test_a_fenced_node_rejoins_in_its_old_place_and_the_job_restores_from_memory() -> None:
    core = fixed_job_with_b_lost()
    body = rejoin("b", 0, {"2": [6, 7, 8], "3": [7, 8]})
    assert schema_errors("join", body) is None
    outs = core.on_join("b", body, 6)
    assert "b" in sends(outs, "welcome")
    assert [o.fields["rejoin_attempt"] for o in outs if isinstance(o, Emit) and o.kind == "join"] == [0]
    assigns = started(core, 6.1)
    assert assigns["b"]["node_rank"] == 1 and assigns["b"]["rank_offset"] == 2
    # Step 8 is newer but rank 0 and 1 never finished it: the newest step every rank holds.
    assert {a["restore_step"] for a in assigns.values()} == {7}
    assert core.transfer_bytes == 100


def test_a_node_back_while_the_others_still_stop_counts_as_stopped() -> None:
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 0, "exitcode": 1, "ts": 2}}, 2)
    core.on_heartbeat("a", HB, 4.6)  # a is busy stopping; b froze before the stop came
    core.tick(5.5)
    assert core.phase is Phase.STOPPING and not core.members.is_active("b")
    outs = core.on_join("b", rejoin("b", 0, {"2": [5], "3": [5]}), 6)
    assert core.phase is Phase.STOPPING  # a has not answered yet: b is not waited for again
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [5], "1": [5]}, "stacks": {}}, 7)
    assert any(isinstance(o, OpenStore) for o in outs)
    assigns = sends(core.start_attempt("", 1, 7), "assign")
    assert {a["restore_step"] for a in assigns.values()} == {5}


def test_a_node_back_from_an_attempt_it_never_started_is_not_waited_for() -> None:
    """b stalled while its workers of attempt 0 were still to start (the zygote importing): it
    says no attempt when it joins again. It is still counted as stopped, with nothing held."""
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 0, "exitcode": 1, "ts": 2}}, 2)
    core.on_heartbeat("a", HB, 4.6)
    core.tick(5.5)
    body = dict(join("b"), snapshots={"2": [5]}, snapshot_bytes={})  # no "attempt"
    core.on_join("b", body, 6)
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [5], "1": [5]}, "stacks": {}}, 7)
    assert any(isinstance(o, OpenStore) for o in outs)  # not held up until the stop timeout
    assigns = sends(core.start_attempt("", 1, 7), "assign")
    assert {a["restore_step"] for a in assigns.values()} == {None}


def test_a_fixed_size_job_whose_lost_node_is_back_restarts_and_does_not_reconfigure() -> None:
    lost = {"kind": "node_lost", "node_id": "b", "host": "hb", "message": "silent", "ts": 3.0, "attempt": 0}
    fixed = DetectDecider().decide([lost], {}, 5.0, max_restarts=3, active_nodes=2, min_nodes=2, max_nodes=2)
    assert fixed.action == "restart" and fixed.severity == "SEV1"
    elastic = DetectDecider().decide([lost], {}, 5.0, max_restarts=3, active_nodes=2, min_nodes=1, max_nodes=2)
    assert elastic.action == "reconfigure"


def test_snapshots_of_an_attempt_the_job_has_left_are_not_restored() -> None:
    """An elastic job re-formed without b and trained on; b's snapshots are of the old line."""
    core = two_nodes_running(ScriptedDecider(RECONFIGURE))
    core.on_heartbeat("a", HB, 3.5)
    core.tick(4.5)
    core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [7], "1": [7]}, "stacks": {}}, 5)
    assigns = sends(core.start_attempt("", 1, 5), "assign")
    assert list(assigns) == ["a"] and assigns["a"]["attempt"] == 1
    outs = core.on_join("b", rejoin("b", 0, {"2": [7], "3": [7]}, mn=1, mx=2), 8)
    assert set(sends(outs, "stop")) == {"a"}  # growing back to 2 nodes
    outs = core.on_stopped("a", {"attempt": 1, "snapshots": {"0": [2], "1": [2]}, "stacks": {}}, 9)
    assert any(isinstance(o, OpenStore) for o in outs)
    assert core.holdings is not None and set(core.holdings.nodes) == {"a"}
    assigns = sends(core.start_attempt("", 1, 9), "assign")
    assert {a["world_size"] for a in assigns.values()} == {4}
    assert {a["restore_step"] for a in assigns.values()} == {None}


def test_a_rejoin_of_a_job_that_is_over_is_refused_plainly() -> None:
    core = fixed_job_with_b_lost()
    core.fail("no store", 6)
    refused = sends(core.on_join("b", rejoin("b", 0, {}), 7), "reject")["b"]
    assert "is over" in refused["reason"] and not refused.get("fenced")


def test_membership_gives_a_returning_node_its_old_rank_unless_taken() -> None:
    m = Membership(1, 2, last_call_s=0, heartbeat_timeout_s=3)
    m.join("a", "ha", 1, None, 0)
    m.join("b", "hb", 1, None, 1)
    assert {n.node_id: n.node_rank for n in m.assign_ranks()} == {"a": 0, "b": 1}
    m.expire(4.5, exempt=frozenset({"b"}))  # a lost
    assert m.join("a", "ha", 1, None, 5).accepted
    assert {n.node_id: n.node_rank for n in m.assign_ranks()} == {"a": 0, "b": 1}
    m.leave("a")
    assert {n.node_id: n.node_rank for n in m.assign_ranks()} == {"b": 0}  # b moved into rank 0
    m.join("a", "ha", 1, None, 6)
    assert {n.node_id: n.node_rank for n in m.assign_ranks()} == {"b": 0, "a": 1}


def test_holdings_need_every_rank_on_its_own_node() -> None:
    h = Holdings(attempt=3, world_size=4)
    h.add("a", {"snapshots": {"0": [4, 5], "1": [5]}, "snapshot_bytes": {"5": 10}})
    h.add("b", {"snapshots": {"2": [5, 6], "3": [3, 5]}, "snapshot_bytes": {"5": 20, "6": 1}})
    assert h.restorable_step([("a", 0, 2), ("b", 2, 2)]) == 5
    assert h.restored_bytes(5, ["a", "b"]) == 30 and h.restored_bytes(5, ["b", "c"]) == 20
    assert h.restorable_step([("b", 0, 2), ("a", 2, 2)]) is None  # swapped: each holds the other's ranks
    assert h.restorable_step([("a", 0, 2), ("c", 2, 2)]) is None  # c holds nothing
    assert h.restorable_step([("a", 0, 2)]) is None  # world size changed
    assert Holdings(0, 0).restorable_step([]) is None
    # A layout that restores nothing says why; one that restores, or no snapshot at all, says nothing.
    assert h.not_restored([("a", 0, 2), ("b", 2, 2)]) == ""
    assert h.not_restored([("a", 0, 2)]) == ("the snapshots kept in memory (newest held by every rank that kept one: "
                                             "step 5; step 6 by some only) cannot be restored: the world size "
                                             "changed (4 -> 2)")
    assert h.not_restored([("a", 0, 2), ("c", 2, 2)]).endswith("rank 2's new node holds no snapshot of it")
    assert h.not_restored([("b", 0, 2), ("a", 2, 2)]).endswith("rank 0 moved to a node that holds no snapshot of it")
    early = Holdings(attempt=0, world_size=2)  # rank 0 failed before its first commit
    early.add("a", {"snapshots": {"1": [1]}})
    # Right with or without a DDP in the script (31A F4: it blamed DDP in a script with none).
    assert early.not_restored([("a", 0, 2)]).endswith("rank 0 made no snapshot in that attempt (it stopped before its "
                                                      "first commit, or made no State; with a DistributedDataParallel "
                                                      "model, the first commit of a fresh start makes none)")
    disjoint = Holdings(attempt=1, world_size=2)
    disjoint.add("a", {"snapshots": {"0": [7], "1": [8]}})
    assert disjoint.not_restored([("a", 0, 2)]) == ("the snapshots kept in memory (newest: step 8, on some ranks "
                                                    "only) cannot be restored: no step is held for every rank")
    assert Holdings(0, 2).not_restored([("a", 0, 2)]) == ""


def test_the_restore_note_names_the_step_a_restore_would_have_given() -> None:
    # Acceptance 33B F2: rank 0 was killed at step 100 before committing it, node b (ranks 2-3)
    # was lost with its snapshots; the note said "newest: step 100", though 99 was all there was.
    h = Holdings(attempt=1, world_size=4)
    h.add("a", {"snapshots": {"0": [98, 99], "1": [99, 100]}})
    assert h.not_restored([("a", 0, 2), ("c", 2, 2)]) == (
        "the snapshots kept in memory (newest held by every rank that kept one: step 99; step 100 by some only) "
        "cannot be restored: rank 2's new node holds no snapshot of it")
    even = Holdings(attempt=1, world_size=4)  # every rank at the same step: said as before
    even.add("a", {"snapshots": {"0": [99, 100], "1": [99, 100]}})
    assert even.not_restored([("a", 0, 2), ("c", 2, 2)]).startswith("the snapshots kept in memory (newest: step 100) ")


def test_snapshot_reports_of_the_wrong_shape_are_skipped() -> None:
    parsed = parse_snapshots({"snapshots": {"0": [1, "2", -3, True, 4], "x": [1], "1": "7", "٣": [1]},
                              "snapshot_bytes": {"4": 5, "5": -1, "z": 3, "6": 2.5}})
    assert parsed.steps == {0: frozenset({1, 4})} and parsed.nbytes == {4: 5}
    assert parse_snapshots({"snapshots": [], "snapshot_bytes": None}).steps == {}
    assert finished_ranks([{"finished": [{"rank": 1, "step": 3}, "x", {"rank": "0"}]}, {}]) == [(1, 3)]


def test_a_silent_node_holds_the_others_to_the_busy_threshold_until_heard_again() -> None:
    """b misses two heartbeats (0.5 s interval): a hears at once that the job is at least busy,
    so its idle ranks, waiting on b's, are not called hung before b is back or declared lost."""
    core = JobCore(spec(), ScriptedDecider(), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_heartbeat("a", HB, 1.0)
    core.on_heartbeat("b", HB, 1.0)
    assert core.next_tick_s(1.2) == pytest.approx(0.801)  # b's (and a's) silence deadline: 2 x 0.5 s
    core.on_heartbeat("a", HB, 1.5)
    acks = sends(core.tick(2.01), "ack")  # b silent for 1.01 s
    assert acks["a"]["activity"] == "busy" and set(acks) == {"a", "b"}
    assert not sends(core.tick(2.2), "ack")  # said once
    assert sends(core.on_heartbeat("a", HB, 2.3), "ack")["a"]["activity"] == "busy"
    # b is back, but its ranks' connections may still be catching up: busy until every rank steps
    assert sends(core.on_heartbeat("b", HB, 2.6), "ack")["b"]["activity"] == "busy"
    assert sends(core.on_heartbeat("a", HB, 2.7), "ack")["a"]["activity"] == "busy"

    def stepped(node: str, ranks: tuple[int, ...], t: float) -> dict[str, Any]:
        return sends(core.on_heartbeat(node, {**HB, "attempt": 0, "workers": [{"rank": r, "step": 1} for r in ranks]},
                                       t), "ack")

    assert stepped("a", (0, 1), 2.8)["a"]["activity"] == "busy"
    assert stepped("b", (2, 3), 2.9)["b"]["activity"] == "idle"
    assert core.phase is Phase.RUNNING and not core.attempt.faults
