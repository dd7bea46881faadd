"""The coordinator's pure core: membership and the job state machine, driven by hand with a
fake clock. No processes, no sockets."""

from __future__ import annotations

from typing import Any

import pytest

from unicron.coord.decide import Decision, DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.membership import Membership
from unicron.coord.outbox import Emit, Finish, OpenStore, Send
from unicron.coord.records import JobSpec, Phase
from unicron.detect.activity import Activity
from unicron.proto.schema import schema_errors


class ScriptedDecider:
    def __init__(self, *decisions: Decision) -> None:
        self.decisions = list(decisions)
        self.seen: list[list[dict[str, Any]]] = []

    def decide(self, faults, stacks, now, **_kw) -> Decision:
        self.seen.append(faults)
        return self.decisions.pop(0)


RESTART = Decision("restart", 0.0, "restart it", "SEV2", "test")


def join(node: str, nproc: int = 2, node_rank: int | None = None, mn: int = 2, mx: int = 2) -> dict[str, Any]:
    return {"node_id": node, "host": f"h-{node}", "nproc": nproc, "node_rank": node_rank, "pid": 1,
            "min_nodes": mn, "max_nodes": mx, "max_restarts": 3, "last_call_s": 5, "heartbeat_timeout_s": 3,
            "join_timeout_s": 60, "stop_timeout_s": 10}


def spec(mn: int = 2, mx: int = 2, interval: float = 0.5) -> JobSpec:
    return JobSpec("job", mn, mx, max_restarts=3, last_call_s=5, heartbeat_timeout_s=3, join_timeout_s=60,
                   stop_timeout_s=10, heartbeat_interval_s=interval)


def sends(outs, kind: str) -> dict[str, dict[str, Any]]:
    return {o.node_id: o.body for o in outs if isinstance(o, Send) and o.kind == kind}


def started(core: JobCore, now: float) -> dict[str, dict[str, Any]]:
    outs = core.tick(now)
    assert any(isinstance(o, OpenStore) for o in outs), outs
    return sends(core.start_attempt("", 1234, now), "assign")


def two_nodes_running(decider: Any, interval: float = 0.5) -> JobCore:
    """An elastic 1..2-node job whose nodes a and b joined at 0 and whose attempt 0 started at 1."""
    core = JobCore(spec(1, 2, interval), decider, now=0)
    core.on_join("a", join("a", mn=1, mx=2), 0)
    core.on_join("b", join("b", mn=1, mx=2), 0)
    started(core, 1)
    return core


def test_membership_honours_requested_ranks_and_keeps_layout() -> None:
    m = Membership(1, 3, last_call_s=1, heartbeat_timeout_s=3)
    assert m.join("a", "ha", 1, None, 0).accepted
    assert m.join("b", "hb", 1, 0, 1).accepted
    assert not m.join("d", "hd", 1, 5, 2).accepted  # not below max
    ranks = {n.node_id: n.node_rank for n in m.assign_ranks()}
    assert ranks == {"b": 0, "a": 1}
    # rank 0 already requested: admitted all the same, in a free rank (torchrun's c10d ignores it)
    taken = m.join("c", "hc", 1, 0, 3)
    assert taken.accepted and "--node-rank 0 is already taken by hb: node hc gets a free node rank" in taken.reason
    assert {n.node_id: n.node_rank for n in m.assign_ranks()} == {"b": 0, "a": 1, "c": 2}
    assert not m.join("e", "he", 1, None, 4).accepted  # full
    epoch = m.epoch
    assert [n.node_id for n in m.expire(10.0)] == ["b", "a", "c"]
    assert m.epoch == epoch + 3


def test_waits_for_min_then_last_call_then_max_starts_at_once() -> None:
    core = JobCore(spec(1, 3), ScriptedDecider(), now=0)
    core.on_join("a", join("a", mn=1, mx=3), 0)
    assert not [o for o in core.tick(1) if isinstance(o, OpenStore)]
    core.on_heartbeat("a", {"workers": [], "health": {}}, 5)
    assert [o for o in core.tick(5.5) if isinstance(o, OpenStore)]  # last call (5 s) over
    core2 = JobCore(spec(1, 2), ScriptedDecider(), now=0)
    core2.on_join("a", join("a", mn=1, mx=2), 0)
    core2.on_join("b", join("b", mn=1, mx=2), 0.1)
    assert [o for o in core2.tick(0.2) if isinstance(o, OpenStore)]


def test_assignment_offsets_and_world() -> None:
    core = JobCore(spec(), ScriptedDecider(), now=0)
    core.on_join("a", join("a", nproc=3), 0)
    core.on_join("b", join("b", nproc=2, node_rank=0), 0)
    assigns = started(core, 1)
    assert assigns["b"]["node_rank"] == 0 and assigns["b"]["rank_offset"] == 0
    assert assigns["a"]["node_rank"] == 1 and assigns["a"]["rank_offset"] == 2
    assert {a["world_size"] for a in assigns.values()} == {5}
    assert assigns["a"]["local_world_sizes"] == [2, 3]
    assert assigns["a"]["inject"] is True and assigns["a"]["restart_count"] == 0


def test_fault_stops_everyone_then_restarts_with_restore_step() -> None:
    decider = ScriptedDecider(RESTART)
    core = JobCore(spec(), decider, now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    assert not [a for a in started(core, 1).values() if "why" in a]  # the first attempt follows no decision
    outs = core.on_fault("b", {"attempt": 0, "fault": {"kind": "exit", "rank": 3, "exitcode": -9, "ts": 2}}, 2)
    assert set(sends(outs, "stop")) == {"a", "b"} and core.phase is Phase.STOPPING
    # A second (victim) report is kept for root-cause analysis, not acted on twice.
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exception", "rank": 0, "ts": 2.1}}, 2.1)
    assert core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [4, 5], "1": [4, 5]}, "stacks": {}}, 3) \
        .__len__() == 1
    outs = core.on_stopped("b", {"attempt": 0, "snapshots": {"2": [5, 6], "3": [4, 5]}, "stacks": {}}, 3)
    assert len(decider.seen[0]) == 2
    assert any(isinstance(o, OpenStore) and o.attempt == 1 for o in outs)
    assigns = sends(core.start_attempt("", 999, 3), "assign")
    assert {a["restore_step"] for a in assigns.values()} == {5}
    assert {a["restart_count"] for a in assigns.values()} == {1}
    assert {a["inject"] for a in assigns.values()} == {False}
    assert core.restarts_used == 1
    # Every node's console is told why (only the node hosting the coordinator sees its events).
    assert {a["why"] for a in assigns.values()} == {"SEV2 restart: restart it"}


def _restart_decided(backoff_s: float) -> tuple[JobCore, list[Any]]:
    """Nodes a and b ran attempt 0; rank 3 (on b) exited 1 at 2, both stopped at 3, and a restart
    backing off ``backoff_s`` was decided: the core and the outputs of that decision."""
    core = JobCore(spec(), ScriptedDecider(Decision("restart", backoff_s, "restart it", "SEV2", "test")), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_fault("b", {"attempt": 0, "fault": {"kind": "exit", "rank": 3, "exitcode": 1, "ts": 2}}, 2)
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 3)
    return core, core.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 3)


def test_every_node_is_told_a_decision_to_restart_as_it_is_taken_not_after_the_backoff() -> None:
    """Acceptance 27B F4: the other nodes' consoles said the decision only with the next
    attempt's assign, after the backoff (up to 30 s), and timed it then."""
    core, outs = _restart_decided(backoff_s=4.0)
    acks = sends(outs, "ack")
    assert set(acks) == {"a", "b"} and {a["decided"] for a in acks.values()} == {"SEV2 restart: restart it"}
    assert not [o for o in outs if isinstance(o, OpenStore)]  # backing off: no attempt yet
    assert all(not schema_errors("ack", a) for a in acks.values())
    assert not any("decided" in a for a in sends(core.on_heartbeat("a", {"workers": [], "health": {}}, 4), "ack").values())


def test_all_finished_ends_the_job() -> None:
    core = JobCore(spec(), ScriptedDecider(), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    assert not [o for o in core.on_finished("a", {"attempt": 0}, 2) if isinstance(o, Finish)]
    finish = [o for o in core.on_finished("b", {"attempt": 0}, 2) if isinstance(o, Finish)]
    assert finish == [Finish(0, "all workers finished successfully")] and core.phase is Phase.DONE


def _b_finished() -> JobCore:
    """Nodes a and b running attempt 0; b's workers all exited 0 at 2."""
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_finished("b", {"attempt": 0}, 2)
    return core


def test_a_node_whose_workers_all_finished_is_not_lost_for_its_silence_while_the_others_train() -> None:
    """Acceptance 23A F3: node b's ranks all exited 0, then its launcher stalled past the
    heartbeat timeout. The others' training was killed to "restart on the same nodes", and the
    job waited the join timeout for b, which exited 0 when it ran again. It did its part: as
    under torchrun, its silence costs nothing. Once the attempt stops for another reason, a
    restart needs it again, and its silence is judged."""
    core = _b_finished()
    for t in (3.0, 5.0, 7.0, 9.0):  # b silent since 2, a heartbeats on
        core.on_heartbeat("a", {"workers": [], "health": {}, "attempt": 0}, t)
        assert not [o for o in core.tick(t + 0.5) if isinstance(o, Emit) and o.kind == "node_lost"]
        assert core._silent(t + 0.5) == frozenset()  # nobody waits on b's ranks: no longer threshold
        assert core.next_tick_s(t + 0.5) >= 0.5  # by a's deadlines only: b's past one made it tick at 20 Hz
    assert [o for o in core.on_finished("a", {"attempt": 0}, 10) if isinstance(o, Finish)] == [
        Finish(0, "all workers finished successfully")]
    # The same silence, then a fault on a: the restart needs b, whose silence counts again.
    core = _b_finished()
    core.on_heartbeat("a", {"workers": [], "health": {}, "attempt": 0}, 8)
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exception", "rank": 0, "ts": 8}}, 8)
    assert core.phase is Phase.STOPPING
    lost = [o for o in core.tick(8.5) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in lost] == ["b"]


def test_a_node_whose_workers_all_finished_may_leave_while_the_others_train() -> None:
    """Acceptance 25A F2: SIGTERM (or Ctrl-C) to node b's launcher after its ranks all exited 0
    stopped a's training and waited the join timeout for b. As its silence (above), b's leaving
    costs nothing: a trains on and the job ends when a finishes."""
    core = _b_finished()
    outs = core.on_leave("b", {"node_id": "b", "reason": "interrupted by SIGTERM"}, 3)
    assert core.phase is Phase.RUNNING and not sends(outs, "stop")
    assert [o for o in core.on_finished("a", {"attempt": 0}, 10) if isinstance(o, Finish)] == [
        Finish(0, "all workers finished successfully")]
    # One that leaves before its workers finished is a fault, as before.
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_leave("b", {"node_id": "b", "reason": "interrupted by SIGTERM"}, 3)
    assert core.phase is Phase.STOPPING


def test_a_rank_that_raised_is_stopped_on_its_node_first_and_the_others_after() -> None:
    """Acceptance 24A F1: the other nodes' ranks were SIGTERMed as the exception was reported,
    while the rank that raised was still exiting (a dcp.async_save in flight with them lost its
    .metadata). As under torchrun, whose other agents learn of it only after its exit: its node
    is told first, the others once it stopped, or half the stop timeout later."""
    core = two_nodes_running(ScriptedDecider(RESTART, RESTART, RESTART))
    outs = core.on_fault("b", {"attempt": 0, "fault": {"kind": "exception", "rank": 3, "ts": 2}}, 2)
    assert set(sends(outs, "stop")) == {"b"} and core.phase is Phase.STOPPING
    # a is told the stop is coming: its ranks wait on rank 3, no hang of theirs (acceptance 25A F4).
    assert sends(outs, "ack")["a"]["stopping"] == 0 and "b" not in sends(outs, "ack")
    assert schema_errors("ack", sends(outs, "ack")["a"]) is None
    assert not sends(core.tick(2.5), "stop")
    outs = core.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 3)
    assert set(sends(outs, "stop")) == {"a"} and not [o for o in outs if isinstance(o, Emit) and o.kind == "decision"]
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 3.5)
    assert [o for o in outs if isinstance(o, Emit) and o.kind == "decision"]
    # Its node slow to stop: the others are told half the stop timeout (10 s) later.
    core = two_nodes_running(ScriptedDecider(RESTART))
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exception", "rank": 0, "ts": 2}}, 2)
    core.on_heartbeat("b", {"workers": [], "health": {}, "attempt": 0}, 6.5)
    assert not sends(core.tick(6.9), "stop") and set(sends(core.tick(7.1), "stop")) == {"b"}
    # Any other fault stops every node at once.
    core = two_nodes_running(ScriptedDecider(RESTART))
    outs = core.on_fault("b", {"attempt": 0, "fault": {"kind": "exit", "rank": 3, "exitcode": 1, "ts": 2}}, 2)
    assert set(sends(outs, "stop")) == {"a", "b"}


def test_lost_node_in_elastic_job_reforms_with_survivors() -> None:
    core = two_nodes_running(ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")))
    core.on_heartbeat("a", {"workers": [], "health": {}}, 3.5)
    outs = core.tick(4.5)  # b silent for 4.5 s > 3 s
    assert any(isinstance(o, Emit) and o.kind == "node_lost" for o in outs)
    assert set(sends(outs, "stop")) == {"a"}
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {"0": [7], "1": [7]}, "stacks": {}}, 5)
    assert any(isinstance(o, OpenStore) for o in outs)
    assigns = sends(core.start_attempt("", 1, 5), "assign")
    assert list(assigns) == ["a"] and assigns["a"]["world_size"] == 2
    assert assigns["a"]["restore_step"] is None  # world size changed: b's ranks are gone


def test_reforming_after_a_loss_waits_for_no_last_call() -> None:
    # Formed at MAX at once; the last call (30 s) would have counted from the first join, so a
    # loss at 4.5 s used to leave the survivors idle until 30 s, silently.
    job = JobSpec("job", 1, 2, max_restarts=3, last_call_s=30, heartbeat_timeout_s=3, join_timeout_s=60,
                  stop_timeout_s=10, heartbeat_interval_s=0.5)
    core = JobCore(job, ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")), now=0)
    core.on_join("a", join("a", mn=1, mx=2), 0)
    core.on_join("b", join("b", mn=1, mx=2), 0)
    started(core, 0.1)
    core.on_heartbeat("a", {"workers": [], "health": {}}, 3.5)
    core.tick(4.5)  # b lost
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 5)
    assert any(isinstance(o, OpenStore) for o in outs), outs


def test_a_fixed_size_job_missing_a_node_says_it_waits_for_it() -> None:
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    core.on_heartbeat("a", {"workers": [], "health": {}}, 3.5)
    core.tick(4.5)  # b lost
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 5)
    waiting = [o.fields for o in outs if isinstance(o, Emit) and o.kind == "waiting_for_nodes"]
    assert waiting == [{"have": 1, "need": 2, "timeout_s": 60}]
    assert core.phase is Phase.WAITING


def test_stop_decision_finishes_with_code_and_stale_messages_are_ignored() -> None:
    core = JobCore(spec(1, 1), ScriptedDecider(Decision("stop", 0, "user error", "FATAL", "import", 1)), now=0)
    core.on_join("a", join("a", mn=1, mx=1), 0)
    started(core, 1)
    assert [o.kind for o in core.on_fault("a", {"attempt": 7, "fault": {"kind": "exit"}}, 2)
            if isinstance(o, Emit)] == ["fault_stale"]
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 0, "ts": 2}}, 2)
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 2)
    assert [o for o in outs if isinstance(o, Finish)] == [Finish(1, "user error")]
    assert core.phase is Phase.FAILED
    assert sends(core.on_join("z", join("z", mn=1, mx=1), 3), "reject")


def test_unacknowledged_stop_times_out_and_node_is_dropped() -> None:
    core = two_nodes_running(ScriptedDecider(RESTART))
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "hang", "ts": 2}}, 2)
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 2.5)
    for t in (3, 4, 5, 6, 7, 8, 9, 10, 11):
        core.on_heartbeat("a", {"workers": [], "health": {}}, t)
        core.on_heartbeat("b", {"workers": [], "health": {}}, t)  # alive, but never acks the stop
        outs = core.tick(t + 0.5)
    outs = core.tick(12.5)
    assert any(isinstance(o, Emit) and o.kind == "node_lost" for o in outs)
    assert any(isinstance(o, OpenStore) for o in outs)


def test_join_refusals() -> None:
    core = JobCore(spec(2, 2), ScriptedDecider(), now=0)
    mismatch = core.on_join("x", join("x", mn=1, mx=2), 0)
    assert "mismatch" in sends(mismatch, "reject")["x"]["reason"]
    # Logged (and so shown on the coordinator's console) once, not at every retry.
    assert [o.fields["waits"] for o in mismatch if isinstance(o, Emit) and o.kind == "join_refused"] == [False]
    assert not [o for o in core.on_join("x", join("x", mn=1, mx=2), 1) if isinstance(o, Emit)]
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    full = core.on_join("c", join("c"), 0)
    assert "full" in sends(full, "reject")["c"]["reason"] and sends(full, "reject")["c"]["wait"] is True
    assert [o.fields["waits"] for o in full if isinstance(o, Emit) and o.kind == "join_refused"] == [True]
    again = core.on_join("c", join("c"), 1)  # the waiting agent asks every second: logged once
    assert sends(again, "reject")["c"]["wait"] is True and not [o for o in again if isinstance(o, Emit)]
    # once b is lost (silent past the heartbeat timeout), c gets its place
    core.on_heartbeat("a", {"workers": [], "health": {}}, 4)
    core.tick(4.0)
    assert "c" in sends(core.on_join("c", join("c"), 4.1), "welcome")


def test_late_joiner_grows_the_job_without_spending_budget() -> None:
    core = JobCore(spec(1, 2), ScriptedDecider(), now=0)
    core.on_join("a", join("a", mn=1, mx=2), 0)
    core.on_heartbeat("a", {"workers": [], "health": {}}, 5.9)
    started(core, 6)
    outs = core.on_join("b", join("b", mn=1, mx=2), 7)
    assert set(sends(outs, "stop")) == {"a"}
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 7.5)
    assert any(isinstance(o, OpenStore) for o in outs)
    assigns = sends(core.start_attempt("", 1, 7.5), "assign")
    assert set(assigns) == {"a", "b"} and core.restarts_used == 0
    # torchrun's TORCHELASTIC_RESTART_COUNT counts failures only: a node joining is none.
    assert {a["attempt"] for a in assigns.values()} == {1} and {a["restart_count"] for a in assigns.values()} == {0}


@pytest.mark.parametrize("held", [{}, {"0": [40, 41], "1": [41]}])
def test_growing_says_that_snapshots_held_in_memory_are_given_up(held: dict[str, list[int]]) -> None:
    # Acceptance 33B F4: the INFO line said only "growing to 3 nodes"; a job that keeps its
    # state only in unicron.State loses all its progress there.
    core = JobCore(spec(1, 2), DetectDecider(), now=0)
    core.on_join("a", join("a", mn=1, mx=2), 0)
    core.on_heartbeat("a", {"workers": [], "health": {}}, 5.9)
    started(core, 6)
    core.on_join("b", join("b", mn=1, mx=2), 7)
    outs = core.on_stopped("a", {"attempt": 0, "snapshots": held, "stacks": {}}, 7.5)
    decision = [o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision"][0]
    assert decision["severity"] == "INFO" and decision["reason"].startswith("node b joined: growing to 2 nodes")
    given_up = "in-memory snapshots cannot be restored at another world size: the job restarts from the script's own"
    assert (given_up in decision["reason"]) is bool(held), decision["reason"]


PEER_RESET = {"kind": "exception", "rank": 2, "error_type": "RuntimeError", "ts": 7.6, "steps_completed": 40,
              "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8108: "
                         "Connection reset by peer"}


@pytest.mark.parametrize("fault, spends", [(PEER_RESET, False),  # the planned stop's doing
                                           (dict(PEER_RESET, message="CUDA error: an illegal memory access"), True)])
def test_a_victim_reported_after_a_late_joiners_stop_is_no_failure(fault: dict[str, Any], spends: bool) -> None:
    # a and b train; c joins and the attempt is stopped to grow. a's ranks stop first; b's
    # launcher carries the stop out late, and its rank reports the reset connection as its fault.
    core = JobCore(spec(1, 3), ScriptedDecider(RESTART), now=0)
    for node in ("a", "b"):
        core.on_join(node, join(node, mn=1, mx=3), 0)
        core.on_heartbeat(node, {"workers": [], "health": {}}, 5.9)
    started(core, 6)
    assert set(sends(core.on_join("c", join("c", mn=1, mx=3), 7), "stop")) == {"a", "b"}
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 7.5)
    core.on_fault("b", {"attempt": 0, "fault": fault}, 7.7)
    outs = core.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 7.8)
    decision = [o.fields for o in outs if isinstance(o, Emit) and o.kind == "decision"]
    assert core.restarts_used == (1 if spends else 0), decision
    assert decision[0]["rule"] == ("test" if spends else "scale-up"), decision
    assigns = sends(core.start_attempt("", 1, 8), "assign")
    assert set(assigns) == {"a", "b", "c"} and {a["restart_count"] for a in assigns.values()} == {int(spends)}


@pytest.mark.parametrize("fault, action", [
    ({"kind": "exit", "rank": 1, "exitcode": -9, "ts": 1.0, "progress": 5}, "restart"),
    ({"kind": "exception", "rank": 0, "error_type": "ModuleNotFoundError",
      "message": "ModuleNotFoundError: No module named 'nope'", "ts": 1.0, "progress": 0,
      "steps_completed": 0}, "stop"),
])
def test_detect_decider_on_real_fault_shapes(fault, action) -> None:
    decision = DetectDecider().decide([dict(fault, node_id="n", host="h", summary="x", pid=3)], {}, 2.0,
                                      max_restarts=3, active_nodes=1, min_nodes=1)
    assert decision.action == action
    if action == "stop":
        assert decision.exit_code != 0


def test_detect_decider_calls_restored_attempts_that_fail_before_new_ground_a_crash_loop() -> None:
    decider = DetectDecider()
    fault = {"kind": "exit", "rank": 1, "exitcode": 1, "node_id": "n", "host": "h", "summary": "x", "pid": 3,
             "stderr_tail": "RuntimeError: loss is nan"}
    first = decider.decide([dict(fault, attempt=0, progress=7, reached=7, restored_from=0, ts=1.0)], {}, 1.0,
                           max_restarts=20, active_nodes=1, min_nodes=1)
    assert first.action == "restart"
    actions = [decider.decide([dict(fault, attempt=n, progress=1, reached=7, restored_from=6, ts=1.0 + n)], {},
                              1.0 + n, max_restarts=20, active_nodes=1, min_nodes=1) for n in (1, 2, 3)]
    assert [d.action for d in actions] == ["restart", "restart", "stop"]
    assert "crash loop" in actions[-1].reason and actions[-1].exit_code != 0
    assert [r.replayed for r in decider.history] == [False, True, True, True]
    # Garbage in the new fields is ignored, never raised.
    other = DetectDecider()
    other.decide([dict(fault, attempt=0, progress=7, reached="7", restored_from=True, ts=1.0)], {}, 1.0,
                 max_restarts=20, active_nodes=1, min_nodes=1)
    assert other.history[-1].reached is None and not other.history[-1].replayed


def test_an_elastic_job_below_its_minimum_is_not_called_not_elastic() -> None:
    lost = {"kind": "node_lost", "node_id": "b", "host": "hb", "message": "no heartbeat", "ts": 1.0, "attempt": 0}
    below = DetectDecider().decide([lost], {}, 1.0, max_restarts=3, active_nodes=1, min_nodes=2, max_nodes=3)
    assert below.action == "restart" and "cannot shrink below --nnodes MIN (2 nodes; 1 left)" in below.reason
    assert "not elastic" not in below.reason
    fixed = DetectDecider().decide([lost], {}, 1.0, max_restarts=3, active_nodes=1, min_nodes=2, max_nodes=2)
    assert fixed.action == "restart" and "not elastic" in fixed.reason


def test_node_busy_stopping_its_workers_is_judged_by_the_stop_timeout() -> None:
    core = two_nodes_running(ScriptedDecider(RESTART))
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "hang", "ts": 2}}, 2)
    # Both agents answer the stop at once, then are silent for 7 s while they stop hung workers
    # (heartbeat timeout is 3 s).
    core.on_heartbeat("a", {"workers": [], "health": {}}, 2)
    core.on_heartbeat("b", {"workers": [], "health": {}}, 2)
    assert not [o for o in core.tick(9) if isinstance(o, Emit) and o.kind == "node_lost"]
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 9.5)
    outs = core.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 9.6)
    assert any(isinstance(o, OpenStore) for o in outs)
    assert len(core.members.active()) == 2


def test_node_frozen_before_the_stop_is_lost_at_the_heartbeat_timeout() -> None:
    # b freezes at 1.5; a's idle rank is called hung at 3; b never answers the stop.
    core = two_nodes_running(ScriptedDecider(RESTART))
    core.on_heartbeat("b", {"workers": [], "health": {}}, 1.5)
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "hang", "ts": 3}}, 3)
    core.on_heartbeat("a", {"workers": [], "health": {}}, 3)
    assert not [o for o in core.tick(4.4) if isinstance(o, Emit) and o.kind == "node_lost"]
    lost = [o for o in core.tick(4.6) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in lost] == ["b"], "judged by the heartbeat timeout, not the stop timeout"


def test_job_activity_is_announced_to_every_agent_when_it_rises() -> None:
    core = JobCore(spec(interval=2.0), ScriptedDecider(), now=0)  # no node falls silent here
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 0)
    beat = {"workers": [], "health": {}, "attempt": 0}
    acks = sends(core.on_heartbeat("a", dict(beat, activity="idle"), 1), "ack")
    assert list(acks) == ["a"] and acks["a"]["activity"] == "idle"
    # b's rank spins on a CPU: a hears it now, not at its next heartbeat.
    acks = sends(core.on_heartbeat("b", dict(beat, activity="busy"), 2), "ack")
    assert set(acks) == {"a", "b"} and all(a["activity"] == "busy" for a in acks.values())
    # ... then evaluates (working): higher again, announced again.
    acks = sends(core.on_heartbeat("b", dict(beat, activity="working"), 2.2), "ack")
    assert set(acks) == {"a", "b"} and all(a["activity"] == "working" for a in acks.values())
    acks = sends(core.on_heartbeat("a", dict(beat, activity="idle"), 2.5), "ack")
    assert list(acks) == ["a"] and acks["a"]["activity"] == "working", "b is still working"
    acks = sends(core.on_heartbeat("b", beat, 3), "ack")  # an agent that sends no activity: idle
    assert list(acks) == ["b"] and acks["b"]["activity"] == "idle"
    assert core.job_activity() is Activity.IDLE
    # Word from an old attempt, or from a node whose workers finished, does not count: a node
    # that finished while working must not keep the other from being called hung.
    assert sends(core.on_heartbeat("a", dict(beat, attempt=-1, activity="working"), 4), "ack")["a"]["activity"] == "idle"
    core.on_finished("b", {"attempt": 0}, 5)
    assert sends(core.on_heartbeat("b", dict(beat, activity="working"), 5.1), "ack")["b"]["activity"] == "idle"


def test_next_tick_s_is_the_first_heartbeat_deadline_while_running() -> None:
    """The coordinator sleeps next_tick_s between messages: a loss must not fall inside it."""
    core = JobCore(spec(1, 2), ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")), now=0)
    assert core.next_tick_s(0) == 0.0  # waiting for nodes: tick at the shell's pace
    core = two_nodes_running(ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")),
                             interval=2.0)  # silent after 4 s: later than lost
    core.on_heartbeat("a", {"workers": [], "health": {}}, 2.0)
    core.on_heartbeat("b", {"workers": [], "health": {}}, 1.5)
    wait = core.next_tick_s(2.0)
    assert wait == pytest.approx(2.5, abs=0.01)  # b's deadline: 1.5 + 3
    assert not [o for o in core.tick(2.0 + wait - 0.002) if isinstance(o, Emit) and o.kind == "node_lost"]
    lost = [o for o in core.tick(2.0 + wait) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in lost] == ["b"]
    assert core.next_tick_s(4.6) == 0.0  # restarting without b: tick at the shell's pace


def test_next_tick_s_is_unbounded_once_the_job_ended() -> None:
    core = JobCore(spec(1, 1), ScriptedDecider(Decision("stop", 0, "user error", "FATAL", "import", 1)), now=0)
    core.on_join("a", join("a", mn=1, mx=1), 0)
    started(core, 0)
    core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 0, "ts": 1}}, 1)
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 1.5)
    assert core.phase in (Phase.DONE, Phase.FAILED)
    assert core.next_tick_s(2.0) == float("inf")


CONNECTION_LOST = {"kind": "exception", "rank": 0, "error_type": "RuntimeError", "ts": 1.0, "progress": 9,
                   "message": "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                              "Connection closed by peer [127.0.0.1]:29500"}


def test_a_rank_that_left_early_is_named_when_its_peers_lost_it_and_a_repeat_stops_the_job() -> None:
    """Ranks that end at different steps: the first time it may be a one-off (a rank preempted
    that saved and left) and is restarted, leading with the rank that left; the same again after
    the restart is the script's own logic (uneven inputs), and the job stops as a user error."""
    decider = DetectDecider()
    decision = decider.decide([CONNECTION_LOST], {}, 2.0, max_restarts=3, active_nodes=1, min_nodes=1,
                              finished=[(1, 10)])
    assert (decision.action, decision.severity, decision.rule) == ("restart", "SEV2", "uneven-end")
    assert decision.reason.startswith("rank 1 after step 10 exited with code 0 while rank 0 still trained, which "
                                      "then lost its peer (RuntimeError: "), decision.reason
    again = decider.decide([dict(CONNECTION_LOST, attempt=1)], {}, 4.0, max_restarts=3, active_nodes=1, min_nodes=1,
                           finished=[(1, 10)])
    assert (again.action, again.severity, again.exit_code) == ("stop", "FATAL", 1)
    assert "again after a restart: ranks that end at different steps" in again.reason.splitlines()[0]
    # Another rank, or another step, after the restart: another one-off (a second preemption)
    other = DetectDecider()
    other.decide([CONNECTION_LOST], {}, 2.0, max_restarts=3, active_nodes=1, min_nodes=1, finished=[(1, 10)])
    later = other.decide([dict(CONNECTION_LOST, attempt=1)], {}, 4.0, max_restarts=3, active_nodes=1, min_nodes=1,
                         finished=[(1, 146)])
    assert (later.action, later.rule) == ("restart", "uneven-end"), later
    # A connection error that is not torch.distributed's (an upload server down after the last
    # step) is not a lost peer: no uneven end, whoever exited 0 before it.
    upload = {"kind": "exception", "rank": 0, "error_type": "ConnectionRefusedError", "ts": 1.0, "progress": 10,
              "message": "ConnectionRefusedError: [Errno 111] Connection refused",
              "traceback": 'File "/usr/lib/python3/urllib/request.py", line 1348, in do_open',
              "stderr_tail": "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"}
    plain = DetectDecider().decide([upload], {}, 2.0, max_restarts=3, active_nodes=1, min_nodes=1,
                                   finished=[(1, 10)])
    assert plain.rule != "uneven-end" and "exited with code 0" not in plain.reason, plain
    # A rank that finished says nothing about a failure of its own kind (a crash, an exception).
    crash = {"kind": "exit", "rank": 0, "exitcode": -11, "ts": 1.0, "progress": 9}
    decision = DetectDecider().decide([crash], {}, 2.0, max_restarts=3, active_nodes=1, min_nodes=1,
                                      finished=[(1, 10)])
    assert "exited with code 0" not in decision.reason


def test_the_core_passes_the_ranks_that_finished_and_skips_garbage() -> None:
    decider = ScriptedDecider(RESTART)
    seen: list[object] = []
    decide = decider.decide
    decider.decide = lambda *a, **kw: (seen.append(kw.get("finished")), decide(*a, **kw))[1]  # type: ignore[method-assign]
    core = JobCore(spec(1, 1), decider, now=0)
    core.on_join("a", join("a", mn=1, mx=1), 0)
    started(core, 0)
    core.on_fault("a", {"attempt": 0, "fault": dict(CONNECTION_LOST)}, 1)
    core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {},
                          "finished": [{"rank": 1, "step": 10}, {"rank": "x"}, 7, {"rank": 2, "step": None}]}, 1.5)
    assert seen == [[(1, 10), (2, None)]]


def test_a_lost_nodes_workers_are_not_shown_running() -> None:
    core = two_nodes_running(ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")))
    core.on_heartbeat("a", {"workers": [{"rank": 0, "state": "running"}], "health": {}}, 3.5)
    core.on_heartbeat("b", {"workers": [{"rank": 2, "state": "running"}, {"rank": 3, "state": "failed"}],
                            "health": {}}, 1.2)
    core.tick(4.5)  # b silent: lost
    nodes = {n["node_id"]: n for n in core.snapshot(4.5)["nodes"]}
    # A rank that failed stays failed (acceptance 25C F1: shown as its node's state, the cause hid).
    assert nodes["b"]["state"] == "lost" and [w["state"] for w in nodes["b"]["workers"]] == ["lost", "failed"]
    assert [w["state"] for w in nodes["a"]["workers"]] == ["running"]


@pytest.mark.timeout(30)
def test_a_node_lost_while_starting_its_workers_shows_every_rank_and_no_live_figures() -> None:
    """Acceptance 33B F3: a node's launcher SIGKILLed while it forked its ranks had last said
    only its first rank (its agent heartbeats between two forks), busy, at 100% CPU; then
    `unicron status` listed ranks 0-2 of a world of 4, and the dead node as busy at 100%."""
    from rich.console import Console

    from unicron.status.render import render_nodes, render_ranks

    core = two_nodes_running(ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")))
    core.on_heartbeat("a", {"workers": [{"rank": 0, "pid": 10, "state": "running", "step": 5},
                                        {"rank": 1, "pid": 11, "state": "running", "step": 5}],
                            "health": {"cpu_percent": 40.0}, "attempt": 0, "activity": "idle"}, 3.5)
    core.on_heartbeat("b", {"workers": [{"rank": 2, "pid": 23501, "state": "running", "step": 0}],
                            "health": {"cpu_percent": 100.0, "mem_percent": 77.0,
                                       "gpus": [{"index": 0, "util": 99, "xid": [79]}]},
                            "attempt": 0, "activity": "busy"}, 1.2)
    core.tick(4.5)  # b silent: lost
    view = core.snapshot(4.5)
    nodes = {n["node_id"]: n for n in view["nodes"]}
    assert nodes["b"]["state"] == "lost" and nodes["b"]["activity"] == "unknown"
    assert nodes["a"]["activity"] == "idle"
    assert [(w["rank"], w["state"], w["pid"]) for w in nodes["b"]["workers"]] == [(2, "lost", 23501), (3, "lost", None)]
    assert nodes["b"]["workers"][1]["local_rank"] == 1
    console = Console(width=200, record=True)
    console.print(render_ranks(view, 4.5))
    console.print(render_nodes(view, 4.5))
    text = console.export_text()
    ranks = [line.split() for line in text.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]
    assert [r[0] for r in ranks[:4]] == ["0", "1", "2", "3"], text
    assert ranks[3][:5] == ["3", "1", "-", "lost", "-"], text
    lost_row = next(line for line in text.splitlines() if " h-b " in line)
    # its last figures (busy, 100% CPU, 77% memory, 99% GPU) are not shown as its load now; its Xid is
    assert "busy" not in lost_row and "%" not in lost_row and "Xid 79" in lost_row, lost_row
    assert "40%" in next(line for line in text.splitlines() if " h-a " in line)


@pytest.mark.timeout(30)
def test_a_lost_nodes_heartbeat_of_an_earlier_attempt_adds_no_rank() -> None:
    """A heartbeat sent before its assign came lists the node's ranks of the attempt before: a
    node lost then shows those, not made-up ones of a layout it never ran."""
    core = two_nodes_running(ScriptedDecider(Decision("reconfigure", 0.0, "lost", "SEV1", "node-lost")))
    core.on_heartbeat("a", {"workers": [], "health": {}}, 3.5)
    core.on_heartbeat("b", {"workers": [{"rank": 0, "state": "exited"}], "health": {}}, 1.2)
    core.tick(4.5)
    nodes = {n["node_id"]: n for n in core.snapshot(4.5)["nodes"]}
    assert [(w["rank"], w["state"]) for w in nodes["b"]["workers"]] == [(0, "exited")]


@pytest.mark.parametrize("outcome, shown", [("finished", "exited"), ("failed", "stopped")])
def test_no_rank_is_shown_running_once_the_job_is_over(outcome: str, shown: str) -> None:
    # A standalone coordinator keeps showing a job that ended: its ranks' last heartbeat said
    # running, but their nodes stopped everything with the job.
    core = two_nodes_running(ScriptedDecider(Decision("stop", 0.0, "budget spent", "SEV2", "test", 1)))
    for node, rank in (("a", 0), ("b", 1)):
        core.on_heartbeat(node, {"workers": [{"rank": rank, "state": "running"},
                                             {"rank": rank + 2, "state": "failed"}], "health": {}}, 1.5)
    if outcome == "finished":
        core.on_finished("a", {"attempt": 0}, 2)
        core.on_finished("b", {"attempt": 0}, 2)
    else:
        core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 2, "ts": 2.0}}, 2)
        core.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 2.1)
        core.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 2.1)
    view = core.snapshot(3)
    assert view["job"]["state"] == ("done" if outcome == "finished" else "failed")
    assert [[w["state"] for w in n["workers"]] for n in view["nodes"]] == [[shown, "failed"]] * 2
    assert [n["state"] for n in view["nodes"]] == [shown] * 2  # not "healthy", its heartbeat ageing (27B F10)
    # Its nodes then leave (they exit with the job): their ranks keep how they ended (26A F4: "left").
    core.on_leave("a", {"node_id": "a", "reason": "the job ended"}, 4)
    core.on_leave("b", {"node_id": "b", "reason": "the job ended"}, 4)
    view = core.snapshot(5)
    assert [n["state"] for n in view["nodes"]] == ["left", "left"]
    assert [[w["state"] for w in n["workers"]] for n in view["nodes"]] == [[shown, "failed"]] * 2


def test_a_coordinator_that_was_itself_stopped_does_not_count_the_silence() -> None:
    core = two_nodes_running(ScriptedDecider(RESTART))
    core.on_heartbeat("a", {"workers": [], "health": {}}, 2.0)
    core.on_heartbeat("b", {"workers": [], "health": {}}, 2.0)
    core.paused(5.0)  # the coordinator's process was stopped for 5 s
    assert not [o for o in core.tick(7.5) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in core.tick(10.1) if isinstance(o, Emit) and o.kind == "node_lost"] \
        == ["a", "b"]  # still silent 3 s after the pause: lost


def test_a_join_timeout_shorter_than_the_last_call_starts_with_the_nodes_there() -> None:
    """MIN nodes are there, the last call (5 s) waits for more, the join timeout (2 s) ends the
    wait: the job starts with what it has rather than failing with enough nodes."""
    core = JobCore(JobSpec("job", 1, 3, max_restarts=3, last_call_s=5, heartbeat_timeout_s=3, join_timeout_s=2),
                   ScriptedDecider(), now=0)
    core.on_join("a", join("a", mn=1, mx=3), 0)
    assert not core.tick(1.9)
    assert [o for o in core.tick(2.1) if isinstance(o, OpenStore)]
    empty = JobCore(JobSpec("job", 1, 3, max_restarts=0, last_call_s=5, heartbeat_timeout_s=3, join_timeout_s=2),
                    ScriptedDecider(), now=0)
    assert [o for o in empty.tick(2.1) if isinstance(o, Finish)] == [
        Finish(4, "rendezvous timed out: 0 of at least 1 node(s) joined within 2 s")]


def test_a_fault_written_by_both_the_agent_and_its_embedded_coordinator_is_shown_once() -> None:
    from unicron.coord.view import distinct_events

    agent = {"kind": "fault", "fault_kind": "exit", "rank": 1, "occurred_at": 5.0, "attempt": 0, "latency_s": 0.01}
    coord = {"kind": "fault", "fault_kind": "exit", "rank": 1, "occurred_at": 5.0, "attempt": 0, "node_id": "b"}
    other = dict(agent, rank=0)
    shown = distinct_events([{"kind": "join"}, agent, coord, other, {"kind": "decision"}])
    assert [e["kind"] for e in shown] == ["join", "fault", "fault", "decision"]
    assert shown[1] == dict(agent, node_id="b") and shown[2] == other
    assert "node_id" not in agent  # the log's own records are left as they were


def test_the_other_failed_ranks_are_named_by_node_like_the_root_cause() -> None:
    crash = {"kind": "exit", "rank": 1, "exitcode": 3, "ts": 1.0, "progress": 0, "node_id": "vm-7-ab12",
             "host": "vm", "summary": "exited with code 3"}
    victim = dict(CONNECTION_LOST, ts=1.5, node_id="vm-8-cd34", host="vm", summary="exited with code 1")
    decision = DetectDecider().decide([crash, victim], {}, 2.0, max_restarts=0, active_nodes=1, min_nodes=1)
    assert decision.action == "stop"
    assert "rank 1 on vm-7-ab12" in decision.reason and "also failed: rank 0 on vm-8-cd34: " in decision.reason, \
        decision.reason


def test_another_failed_rank_is_named_once_with_its_first_report() -> None:
    crash = {"kind": "exit", "rank": 1, "exitcode": -9, "ts": 1.0, "progress": 3, "node_id": "b", "host": "vm"}
    victim = dict(CONNECTION_LOST, ts=1.5, node_id="a", host="vm")
    its_exit = {"kind": "exit", "rank": 0, "exitcode": 1, "ts": 1.6, "node_id": "a", "host": "vm",
                "summary": "exited with code 1"}
    decision = DetectDecider().decide([crash, victim, its_exit], {}, 2.0, max_restarts=0, active_nodes=1,
                                      min_nodes=1)
    assert decision.reason.count("also failed: rank 0") == 1, decision.reason


def test_a_hang_after_another_nodes_rank_finished_is_a_tail_not_a_fault() -> None:
    """Node b's workers all exited 0: a's ranks are past the last step (an upload, a final
    checkpoint), so a's hang report is ignored, and a is told at once not to call one."""
    core = two_nodes_running(ScriptedDecider(RESTART))
    assert "done" not in sends(core.on_heartbeat("a", {"attempt": 0, "workers": [], "health": {}}, 1.5), "ack")["a"]
    outs = core.on_finished("b", {"attempt": 0}, 2)
    assert sends(outs, "ack")["a"]["done"] == 0 and core.past_last_step()
    outs = core.on_fault("a", {"attempt": 0, "fault": {"kind": "hang", "ts": 3.5, "message": "idle"}}, 3.5)
    assert [o.kind for o in outs if isinstance(o, Emit)] == ["hang_ignored"] and not sends(outs, "stop")
    assert core.phase is Phase.RUNNING and core.attempt is not None and core.attempt.faults == []
    # A rank that fails for real in its tail is still a fault.
    outs = core.on_fault("a", {"attempt": 0, "fault": {"kind": "exit", "rank": 0, "exitcode": 1, "ts": 4}}, 4)
    assert set(sends(outs, "stop")) == {"a", "b"}


def test_a_node_with_one_rank_done_tells_the_others_at_once() -> None:
    """b's heartbeat says one of its ranks is past its last step (exited 0, destroyed its
    process group) while its other rank lives on: every agent hears it, for this attempt only."""
    core = two_nodes_running(ScriptedDecider(RESTART))
    outs = core.on_heartbeat("b", {"attempt": 0, "workers": [], "health": {}, "done": True}, 2)
    assert {n: body.get("done") for n, body in sends(outs, "ack").items()} == {"a": 0, "b": 0}
    outs = core.on_heartbeat("b", {"attempt": 0, "workers": [], "health": {}, "done": True}, 2.5)
    assert list(sends(outs, "ack")) == ["b"]  # told once; later acks still carry it
    assert sends(outs, "ack")["b"]["done"] == 0
    # Its rank made a new process group (init_process_group after destroy): training again.
    outs = core.on_heartbeat("b", {"attempt": 0, "workers": [], "health": {}, "done": False}, 3)
    assert {n: "done" in body for n, body in sends(outs, "ack").items()} == {"a": False, "b": False}
    assert not core.past_last_step()
    stale = two_nodes_running(ScriptedDecider(RESTART))
    stale.on_heartbeat("b", {"attempt": 7, "workers": [], "health": {}, "done": True}, 2)  # another attempt's word
    assert not stale.past_last_step()


def test_a_rank_training_on_alone_ahead_of_a_waiting_one_makes_the_job_working() -> None:
    """Uneven end across nodes: b's rank waits at a final barrier at step 20 while a's trains on
    alone: the job is working (every agent told at once), until a's rank stops stepping too."""
    core = two_nodes_running(ScriptedDecider(RESTART))

    def beat(node: str, step: int, t: float) -> list[Any]:
        return core.on_heartbeat(node, {"attempt": 0, "workers": [{"rank": 0 if node == "a" else 1, "step": step}],
                                        "health": {}, "activity": "idle"}, t)

    beat("a", 20, 2.0)
    beat("b", 20, 2.0)
    assert core.job_activity(2.1) is Activity.IDLE
    assert sends(beat("a", 21, 2.5), "ack")["a"]["activity"] == "idle"  # one ahead: the step in flight
    outs = beat("a", 23, 3.0)
    assert {n: body["activity"] for n, body in sends(outs, "ack").items()} == {"a": "working", "b": "working"}
    beat("b", 20, 3.2)
    beat("a", 23, 3.8)  # a's rank stopped too
    assert core.job_activity(3.9) is Activity.WORKING and core.job_activity(4.1) is Activity.IDLE  # 2 x 0.5 s
    core.on_heartbeat("a", {"attempt": 0, "workers": [{"rank": "x"}, 7, {"rank": 0, "step": 1.5}], "health": {}}, 4.2)
    assert core.attempt is not None and core.attempt.steps[0] == (23, 3.0)  # garbage skipped


def test_nodes_waiting_for_a_place_are_told_when_the_job_ends() -> None:
    core = JobCore(spec(), ScriptedDecider(), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    assert sends(core.on_join("c", join("c"), 1.5), "reject")["c"]["wait"] is True
    core.on_finished("a", {"attempt": 0}, 2)
    outs = core.on_finished("b", {"attempt": 0}, 2)
    told = sends(outs, "reject")
    assert list(told) == ["c"] and "wait" not in told["c"]
    assert told["c"]["reason"] == "job 'job' ended: all workers finished successfully"
    assert isinstance(outs[-1], Finish)  # after the word to c: a Finish stops serving the job


def test_a_node_with_other_hang_settings_is_refused_with_the_flags_named() -> None:
    hang = {"--hang-floor": 1.5, "--hang-factor": 3.0}
    core = JobCore(JobSpec("job", 2, 2, max_restarts=3, hang=hang), ScriptedDecider(), now=0)
    assert sends(core.on_join("a", {**join("a"), "hang": dict(hang)}, 0), "welcome")
    told = sends(core.on_join("b", {**join("b"), "hang": {**hang, "--hang-floor": 10.0}}, 0), "reject")["b"]
    assert told["reason"] == ("hang settings differ from the job's (give every node the same): this node has "
                              "--hang-floor 10.0, the job's 1.5") and "wait" not in told
    assert sends(core.on_join("b", {**join("b"), "hang": dict(hang)}, 1), "welcome")


def test_a_node_with_another_restart_budget_is_refused() -> None:
    """Restarts are counted job-wide: a node that asked for --max-restarts 0 in a job started
    with 3 would otherwise see the job restart with no word of whose budget was used."""
    core = JobCore(JobSpec("job", 2, 2, max_restarts=3), ScriptedDecider(), now=0)
    assert sends(core.on_join("a", {**join("a"), "max_restarts": 3}, 0), "welcome")
    told = sends(core.on_join("b", {**join("b"), "max_restarts": 0}, 0), "reject")["b"]
    assert told["reason"] == ("--max-restarts mismatch: this node says 0, the job's is 3 (restarts are counted "
                              "job-wide: give every node the same)") and "wait" not in told
    assert sends(core.on_join("b", {**join("b"), "max_restarts": 3}, 1), "welcome")


def test_after_a_silent_node_is_heard_again_the_job_stays_busy_until_every_rank_steps() -> None:
    """A 2 s network blip on b: while b is silent the job is busy; once b is heard again its
    ranks' connections may still wait for TCP's backed-off retransmissions, so the job stays
    busy until every rank has stepped (acceptance pass 14: the idle threshold called the blip a
    hang 1.2 s after the link came back, and torchrun's default budget ended the job)."""
    core = two_nodes_running(ScriptedDecider(RESTART))

    def beat(node: str, step: int, t: float) -> list[Any]:  # a holds ranks 0-1, b ranks 2-3
        ranks = (0, 1) if node == "a" else (2, 3)
        return core.on_heartbeat(node, {"attempt": 0, "workers": [{"rank": r, "step": step} for r in ranks],
                                        "health": {}, "activity": "idle"}, t)

    beat("a", 20, 2.0)
    beat("b", 20, 2.0)
    assert core.job_activity(2.1) is Activity.IDLE
    beat("a", 20, 3.0)  # b's link is down from 2.0 s
    core.tick(3.2)  # b silent: the others are told the job is busy
    assert core.job_activity(3.2) is Activity.BUSY
    outs = beat("b", 20, 4.0)  # the link is back: b is heard, its rank still waits in the collective
    assert sends(outs, "ack")["b"]["activity"] == "busy"
    assert core.job_activity(4.5) is Activity.BUSY and core.job_activity(9.0) is Activity.BUSY
    beat("a", 21, 5.0)
    assert core.job_activity(5.1) is Activity.BUSY  # b's rank has not stepped since
    beat("b", 21, 5.2)
    assert core.job_activity(5.3) is Activity.IDLE  # every rank stepped after the blip: as before


@pytest.mark.parametrize("nnodes, rank_node", [(1, "n"), (2, "n")])
def test_a_script_bug_that_repeats_is_not_told_to_use_an_elastic_range(nnodes: int, rank_node: str) -> None:
    # Elasticity would not help: no node is left out for a script's own exception, and a one-node
    # job has no node to go on without. The stop says what failed points at the script.
    decider = DetectDecider()
    fault = {"kind": "exception", "rank": 0, "node_id": rank_node, "host": "h", "error_type": "KeyError",
             "message": "'shard_0007 missing from the index file'", "steps_completed": 0, "progress": 0}
    kw = {"max_restarts": 3, "active_nodes": nnodes, "min_nodes": nnodes, "max_nodes": nnodes}
    assert decider.decide([dict(fault, attempt=0, ts=1.0)], {}, 1.0, **kw).action == "restart"
    again = decider.decide([dict(fault, attempt=1, ts=2.0)], {}, 2.0, **kw)
    assert again.action == "stop" and "points at the script" in again.reason, again
    assert "--nnodes MIN:MAX" not in again.reason and "not elastic" not in again.reason, again


def test_the_node_hosting_the_store_gets_node_rank_0_unless_another_asked_for_it() -> None:
    # torchrun: MASTER_ADDR is the host of rank 0; a script may start its own server there on rank 0.
    m = Membership(2, 2, last_call_s=1, heartbeat_timeout_s=3)
    m.join("b", "hb", 1, None, 0)
    m.join("a", "ha", 1, None, 1)  # the store's node, joining second
    assert [n.node_id for n in m.assign_ranks(first={"a"})] == ["a", "b"]
    assert [n.node_id for n in m.assign_ranks(first={"a"})] == ["a", "b"]  # kept
    asked = Membership(2, 2, last_call_s=1, heartbeat_timeout_s=3)
    asked.join("b", "hb", 1, 0, 0)  # --node-rank 0 given: honoured
    asked.join("a", "ha", 1, None, 1)
    assert [n.node_id for n in asked.assign_ranks(first={"a"})] == ["b", "a"]


def test_a_node_gone_before_the_first_attempt_is_said_with_what_the_job_waits_for() -> None:
    # The job was forming (no attempt yet): without a word its host's console would wait out the
    # join timeout in silence.
    core = JobCore(spec(3, 3), ScriptedDecider(), now=0)
    core.on_join("a", join("a", mn=3, mx=3), 0)
    core.on_join("b", join("b", mn=3, mx=3), 0)
    left = [o for o in core.on_leave("b", {"reason": "lost the coordinator"}, 1) if isinstance(o, Emit)]
    waiting = [o.fields for o in left if o.kind == "waiting_for_nodes"]
    assert waiting == [{"have": 1, "need": 3, "timeout_s": 60, "gone": "node h-b left: lost the coordinator"}]
    core.on_join("c", join("c", mn=3, mx=3), 2)
    core.on_heartbeat("c", {"workers": [], "health": {}}, 9)
    lost = [o.fields for o in core.tick(10) if isinstance(o, Emit) and o.kind == "waiting_for_nodes"]
    assert len(lost) == 1 and lost[0]["have"] == 1 and lost[0]["gone"].startswith("node h-a lost: no heartbeat"), lost


def test_a_lost_nodes_restarts_back_off_only_while_the_heartbeats_heard_no_new_step() -> None:
    """Acceptance 20B F1: a node lost again and again (frozen, paused) backed off 1, 2, 4 ... 30 s
    though every attempt trained hundreds of steps: a lost node's fault carries no progress,
    and its peers, waiting in a collective, report no fault. The heartbeats' steps stand in."""
    from unicron.coord.decide import decide_attempt, heard_progress
    from unicron.coord.records import Attempt

    spec = JobSpec("job", 2, 2, max_restarts=20)

    def lost_after(decider: DetectDecider, number: int, steps: tuple[int, int] | None, restored: int) -> Decision:
        attempt = Attempt(number, float(number), ["a", "b"], 2, restore_step=restored)
        if steps is not None:
            for rank, step in enumerate(steps):
                attempt.progress.note(rank, step, float(number) + 0.5)
        attempt.faults.append({"kind": "node_lost", "node_id": "b", "host": "hb", "message": "no heartbeat",
                               "ts": float(number) + 0.9, "attempt": number})
        return decide_attempt(decider, attempt, spec, {}, float(number) + 1, active_nodes=2, spent=number)

    trained = DetectDecider()
    backoffs = [lost_after(trained, n, (restore + 150, restore + 149), restore).backoff_s
                for n, restore in enumerate((0, 150, 300, 450))]
    assert backoffs == [0.0, 0.0, 0.0, 0.0]
    unheard = DetectDecider()  # no step reported (--no-inject): unknown, as before
    assert [lost_after(unheard, n, None, 0).backoff_s for n in range(4)] == [0.0, 1.0, 2.0, 4.0]
    stuck = DetectDecider()  # heartbeats at the restored step only: no proof of none, still unknown
    assert [lost_after(stuck, n, (40, 40), 40).action for n in range(3)] == ["restart"] * 3
    assert heard_progress(Attempt(0, 0.0, ["a"], 1, restore_step=40)) is None


def test_the_status_view_shows_the_newest_gone_nodes_only() -> None:
    """Acceptance 20B F4: every replaced node (a launcher killed and started again) stayed in
    `unicron status` as a "lost" row for the rest of the job: one more row per replacement."""
    from unicron.status.render import render_nodes

    core = JobCore(spec(1, 12), ScriptedDecider(RESTART), now=0)
    for i in range(12):
        core.on_join(f"n{i}", join(f"n{i}", mn=1, mx=12), 0.1 * i)
    for now in (1.0, 2.0, 3.0, 4.0, 5.0):
        for live in ("n10", "n11"):
            core.on_heartbeat(live, {"workers": [], "health": {}}, now)
        core.tick(now)
    view = core.snapshot(5.0)
    states = [n["state"] for n in view["nodes"]]
    assert states.count("healthy") == 2 and states.count("lost") == 8 and len(states) == 10, states
    assert view["job"]["gone_nodes_not_shown"] == 2
    shown = {n["node_id"] for n in view["nodes"]}
    assert {"n0", "n1"}.isdisjoint(shown) and {"n2", "n9"} <= shown  # the newest heard of are kept
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_nodes(view, 5.0))
    assert "2 earlier nodes that left or were lost not shown" in console.export_text()


def test_a_node_leaving_during_a_restarts_backoff_is_said_with_what_the_job_waits_for() -> None:
    """Acceptance 28B F1: a node that left (Ctrl-C) while a restart backed off left the
    coordinator's console silent until the join timeout, 600 s later."""
    core, _ = _restart_decided(backoff_s=8.0)
    assert core.phase is Phase.WAITING  # backing off 8 s
    outs = core.on_leave("b", {"node_id": "b", "reason": "interrupted by SIGINT"}, 5)
    waiting = [o.fields for o in outs if isinstance(o, Emit) and o.kind == "waiting_for_nodes"]
    assert waiting == [{"have": 1, "need": 2, "timeout_s": 60, "left": "node h-b left: interrupted by SIGINT"}]


@pytest.mark.timeout(30)
def test_an_ended_job_says_when_it_ended_so_its_up_time_stops() -> None:
    """Acceptance 29C F7: a standalone coordinator keeps showing a job that timed out waiting
    for nodes, and its "up" kept growing; the view had no end time to stop at."""
    from unicron.status.render import render_header

    core = JobCore(spec(), ScriptedDecider(RESTART), now=1000)
    core.on_join("a", join("a"), 1000)
    assert core.snapshot()["job"]["ended_at"] is None
    assert [o for o in core.tick(1070) if isinstance(o, Finish)] and core.phase is Phase.FAILED
    job = core.snapshot()["job"]
    assert job["ended_at"] == 1070
    for later in (1070, 1070 + 86_400):
        assert "up 1m10s" in render_header(core.snapshot(), later).plain


def test_a_fault_for_a_rank_outside_the_attempt_is_refused_not_acted_on() -> None:
    # Rank 99 in a world of 4 comes from no agent (a signed peer's): it restarted the job as
    # "rank 99 ... exited with code 1" (acceptance 30B F2).
    core = JobCore(spec(), ScriptedDecider(RESTART), now=0)
    core.on_join("a", join("a"), 0)
    core.on_join("b", join("b"), 0)
    started(core, 1)
    outs = core.on_fault("b", {"attempt": 0, "fault": {"kind": "exit", "rank": 99, "exitcode": 1, "ts": 2}}, 2)
    refused = [o for o in outs if isinstance(o, Emit) and o.kind == "fault_refused"]
    assert refused and "rank 99" in refused[0].fields["why"] and core.phase is Phase.RUNNING
    assert not sends(outs, "stop")
