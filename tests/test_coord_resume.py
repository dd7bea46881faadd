"""A restarted coordinator takes back the attempt its nodes run: the pure core
(``unicron.coord.resume``) and the agent's side of the message (``resume_fields``), driven by
hand with a fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from test_coord_core import RESTART, ScriptedDecider, join, sends, spec, started

from unicron.agent.joining import JoinState, Refusal, Resume, resume_fields
from unicron.coord.decide import Decision
from unicron.coord.job import JobCore
from unicron.coord.outbox import Emit, Finish, OpenStore, Send
from unicron.coord.records import Phase
from unicron.coord.resume import parse_resume, store_opened_again
from unicron.proto.schema import schema_errors

HB: dict[str, Any] = {"workers": [], "health": {}, "attempt": 3}
FAULT = {"kind": "exit", "rank": 2, "ts": 50.0, "message": "rank 2 exited with code 1", "exitcode": 1}


def first_assigns() -> dict[str, dict[str, Any]]:
    """The assigns a first coordinator gave a fixed 2-node job (a: ranks 0-1, b: ranks 2-3)."""
    old = JobCore(spec(), ScriptedDecider(), now=0)
    old.on_join("a", join("a"), 0)
    old.on_join("b", join("b"), 0)
    return started(old, 1)


def resumed_join(node: str, assign: dict[str, Any], state: str = "running", attempt: int = 3,
                 restarts: int = 2, faults: list[dict[str, Any]] | None = None,
                 snapshots: dict[str, list[int]] | None = None, started: bool = True,
                 untouched: bool = False) -> dict[str, Any]:
    """The join of ``node`` resuming ``assign`` (made the agent's way), as if it were attempt
    ``attempt`` with ``restarts`` restarts spent."""
    assign = dict(assign, attempt=attempt, restarts_used=restarts)
    body = dict(join(node), **resume_fields(assign, epoch=7, state=state, faults=faults or [],
                                            snapshots=snapshots or {}, snapshot_bytes={}, started=started,
                                            store_untouched=untouched))
    assert schema_errors("join", body) is None
    return body


def next_assigns(core: JobCore, now: float) -> dict[str, dict[str, Any]]:
    """The assigns of the attempt after a stop (its store asked for as the stop ended)."""
    assert core.phase is Phase.WAITING and core.store_pending
    return sends(core.start_attempt("", 1234, now), "assign")


def taken_back(*decisions: Decision) -> tuple[JobCore, dict[str, dict[str, Any]]]:
    """A new coordinator's core that node a resumed attempt 3 with (restarts 2 spent)."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(*decisions), now=100)
    outs = core.on_join("a", resumed_join("a", assigns["a"]), 100)
    assert "a" in sends(outs, "welcome")
    return core, assigns


def test_the_assign_names_the_attempts_nodes_and_the_budget_spent() -> None:
    assigns = first_assigns()
    assert assigns["a"]["nodes"] == [["a", "h-a"], ["b", "h-b"]] and assigns["b"]["restarts_used"] == 0
    assert all(schema_errors("assign", body) is None for body in assigns.values())


def test_the_first_resume_takes_the_attempt_back_as_it_was() -> None:
    core, assigns = taken_back()
    assert core.phase is Phase.RUNNING and core.attempt is not None
    assert core.attempt.number == 3 and core.attempt.nodes == ["a", "b"] and core.attempt.world_size == 4
    assert core.next_attempt == 4 and core.restarts_used == 2 and core.members.epoch >= 7
    assert [n.node_rank for n in core.members.active()] == [0, 1]
    # b has not said what it did meanwhile: its heartbeat (fault, stop, finish) asks it to.
    assert core.awaits_resume("b") and not core.awaits_resume("a")
    refused = sends(core.on_unresumed("b", HB, 100.5), "reject")["b"]
    assert refused["unknown_job"] is True and schema_errors("reject", refused) is None
    outs = core.on_join("b", resumed_join("b", assigns["b"]), 101)
    assert "b" in sends(outs, "welcome") and not [o for o in outs if isinstance(o, Emit) and o.kind == "stop"]
    assert "b" in sends(core.on_heartbeat("b", HB, 101.5), "ack")
    assert core.phase is Phase.RUNNING and core.members.nodes["b"].host == "h-b"


def test_after_a_take_back_a_fault_restarts_the_next_attempt_on_the_budget_left() -> None:
    core, assigns = taken_back(RESTART)
    core.on_join("b", resumed_join("b", assigns["b"]), 101)
    outs = core.on_fault("b", {"attempt": 3, "fault": FAULT}, 102)
    assert set(sends(outs, "stop")) == {"a", "b"}
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 103)
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 103)
    new = next_assigns(core, 103.1)
    assert {a["attempt"] for a in new.values()} == {4} and {a["restart_count"] for a in new.values()} == {3}
    assert {a["restarts_used"] for a in new.values()} == {3}
    assert new["a"]["node_rank"] == 0 and new["b"]["node_rank"] == 1


def test_a_node_that_never_resumes_is_lost_at_the_heartbeat_timeout() -> None:
    core, _ = taken_back()
    core.on_heartbeat("a", HB, 102)
    lost = [o for o in core.tick(103.1) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in lost] == ["b"]
    assert core.phase is not Phase.RUNNING


def test_a_node_that_never_resumes_is_lost_at_the_heartbeat_timeout_also_when_the_resume_stops_the_attempt() -> None:
    # The coordinator and node b died together: a's resume carries its rank's lost peer, which
    # stops the attempt at the instant b was taken back. b, never heard, counted as "heard since
    # the stop" and was lost only at the stop timeout, 20 s on, with the peer's error as the
    # cause (acceptance 29B F2).
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(RESTART), now=100)
    peer_lost = dict(FAULT, kind="exception", rank=0, message="rank 0 lost its connection to a peer")
    outs = core.on_join("a", resumed_join("a", assigns["a"], faults=[peer_lost]), 100)
    assert "a" in sends(outs, "welcome") and core.phase is Phase.STOPPING
    core.on_heartbeat("a", HB, 102)
    lost = [o for o in core.tick(103.1) if isinstance(o, Emit) and o.kind == "node_lost"]
    assert [o.fields["node_id"] for o in lost] == ["b"] and "silent_s" in lost[0].fields


def test_a_fault_reported_while_no_coordinator_listened_comes_with_the_resume_once() -> None:
    decider = ScriptedDecider(RESTART)
    core, assigns = taken_back()
    core.decider = decider
    # The fault was queued for the old coordinator and reaches the new one too: counted once.
    core.on_fault("b", {"attempt": 3, "fault": FAULT}, 100.2)
    outs = core.on_join("b", resumed_join("b", assigns["b"], faults=[FAULT]), 100.5)
    assert [o for o in outs if isinstance(o, Emit) and o.kind == "fault"] == []
    assert core.phase is Phase.STOPPING
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 101)
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 101)
    assert [[f["message"] for f in faults] for faults in decider.seen] == [[FAULT["message"]]]


def test_a_fault_carried_only_by_the_resume_stops_the_attempt() -> None:
    core, assigns = taken_back(RESTART)
    outs = core.on_join("b", resumed_join("b", assigns["b"], faults=[FAULT]), 101)
    assert [o.fields["rank"] for o in outs if isinstance(o, Emit) and o.kind == "fault"] == [2]
    assert set(sends(outs, "stop")) == {"a", "b"} and "rank 2" in core.attempt.stop_reason


def test_a_node_that_resumes_after_the_stop_went_out_is_told_to_stop() -> None:
    """Acceptance 21C F5: b's resume carried a fault, and the stop went to a, whose socket had
    not reconnected to the new coordinator yet. a resumes running: it gets the stop now, rather
    than being declared lost at the stop timeout."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(RESTART), now=100)
    core.on_join("b", resumed_join("b", assigns["b"], faults=[FAULT]), 100)
    assert core.phase is Phase.STOPPING
    outs = core.on_join("a", resumed_join("a", assigns["a"]), 101)
    assert sends(outs, "stop")["a"]["attempt"] == 3 and "rank 2" in sends(outs, "stop")["a"]["reason"]
    assert schema_errors("stop", sends(outs, "stop")["a"]) is None


def test_ranks_still_starting_when_the_coordinator_restarted_re_form_at_once_on_no_budget() -> None:
    """Acceptance 21C F4: the attempt's store died with the old coordinator; ranks not past
    init_process_group would wait for it until torch's store timeout, stepping nothing. The
    new coordinator re-forms the job (a fresh store), spending no restart."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    core.on_join("a", resumed_join("a", assigns["a"]), 100)
    assert core.phase is Phase.RUNNING  # a's ranks are past it: nothing to do for them
    outs = core.on_join("b", resumed_join("b", assigns["b"], started=False), 100.5)
    assert set(sends(outs, "stop")) == {"a", "b"} and "store is gone" in core.attempt.stop_reason
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 101)
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 101)
    new = next_assigns(core, 101.1)
    assert {a["attempt"] for a in new.values()} == {4} and {a["restarts_used"] for a in new.values()} == {2}


def test_ranks_that_have_not_called_init_process_group_anywhere_get_their_store_back_on_its_port() -> None:
    """Acceptance 23A F1: no rank of any node has called init_process_group (a script that
    loads first, or never calls it): the store is opened again, empty, where the ranks look for
    it, and the attempt trains on: nothing is re-formed, nothing redone."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    outs = core.on_join("a", resumed_join("a", assigns["a"], started=False, untouched=True), 100)
    opens = [o for o in outs if isinstance(o, OpenStore)]
    assert opens == [OpenStore(3, port=assigns["a"]["master_port"], addr=assigns["a"]["master_addr"])]
    outs = core.on_join("b", resumed_join("b", assigns["b"], started=False, untouched=True), 100.2)
    assert not [o for o in outs if isinstance(o, OpenStore)] and not sends(outs, "stop")  # opened once
    outs = store_opened_again(core, 3, assigns["a"]["master_port"], "", 101)
    assert core.phase is Phase.RUNNING and [o.kind for o in outs if isinstance(o, Emit)] == ["store_reopened"]


@pytest.mark.parametrize("b_said", [{"started": False}, {"started": True}], ids=["in-init", "past-init"])
def test_ranks_that_have_not_begun_beside_ranks_that_used_the_store_re_form(b_said: dict[str, bool]) -> None:
    """Ranks in init_process_group used the dead store; ranks past it (NCCL's rendezvous is
    lazy) may have left keys in it that the others would wait for: an empty store would hang
    the rendezvous, so the job re-forms on no budget, whichever node resumed first."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    core.on_join("a", resumed_join("a", assigns["a"], started=False, untouched=True), 100)
    assert core.phase is Phase.RUNNING
    outs = core.on_join("b", resumed_join("b", assigns["b"], **b_said), 100.2)
    assert set(sends(outs, "stop")) == {"a", "b"} and "store is gone" in core.attempt.stop_reason
    assert core.restarts_used == 2


def test_a_store_that_cannot_be_opened_again_re_forms_the_job() -> None:
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    core.on_join("a", resumed_join("a", assigns["a"], started=False, untouched=True), 100)
    core.on_join("b", resumed_join("b", assigns["b"], started=False, untouched=True), 100.2)
    outs = store_opened_again(core, 3, 4321, "address already in use", 101)
    assert set(sends(outs, "stop")) == {"a", "b"}
    assert "port 4321 (address already in use)" in core.attempt.stop_reason


STORE_LOST = {"kind": "exception", "rank": 2, "ts": 99.0, "error_type": "torch.distributed.DistNetworkError",
              "message": "Failed to recv, got 0 bytes. Connection was likely closed."}


@pytest.mark.parametrize("how", ["in-the-resume", "reported-after"])
def test_ranks_that_lost_the_store_with_the_old_coordinator_re_form_the_job_on_no_budget(how: str) -> None:
    """Acceptance 26A F1: ranks in init_process_group do not wait for the dead store, they fail
    on it at once (DistNetworkError). That was handled as the job's own fault: a restart of the
    budget spent, or the job ended with --max-restarts 0. It is the coordinator's doing."""
    assigns = first_assigns()
    decider = ScriptedDecider(RESTART)
    core = JobCore(spec(), decider, now=100)
    core.on_join("a", resumed_join("a", assigns["a"]), 100)
    if how == "in-the-resume":
        outs = core.on_join("b", resumed_join("b", assigns["b"], faults=[STORE_LOST]), 100.2)
    else:
        core.on_join("b", resumed_join("b", assigns["b"]), 100.2)
        outs = core.on_fault("b", {"attempt": 3, "fault": STORE_LOST}, 101)
    assert set(sends(outs, "stop")) == {"a", "b"} and "lost the attempt's store" in core.attempt.stop_reason
    assert [o.fields.get("store_gone") for o in outs if isinstance(o, Emit) and o.kind == "fault"] == [True]
    victim = {"kind": "exit", "rank": 0, "ts": 101.5, "exitcode": 1, "message": "Connection closed by peer"}
    core.on_fault("a", {"attempt": 3, "fault": victim}, 101.5)  # the stop's own doing
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    assert decider.seen == [] and core.restarts_used == 2
    assert {a["attempt"] for a in next_assigns(core, 102.1).values()} == {4}


def test_a_real_fault_beside_store_losses_in_a_resume_is_the_cause_and_both_are_logged() -> None:
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(RESTART), now=100)
    core.on_join("a", resumed_join("a", assigns["a"]), 100)
    outs = core.on_join("b", resumed_join("b", assigns["b"], faults=[STORE_LOST, dict(FAULT, rank=3)]), 100.2)
    logged = [o.fields for o in outs if isinstance(o, Emit) and o.kind == "fault"]
    assert sorted(f["rank"] for f in logged) == [2, 3] and [f.get("store_gone") for f in logged].count(True) == 1
    assert "rank 3" in core.attempt.stop_reason and [f["rank"] for f in core.attempt.faults] == [3]


def test_a_store_error_in_an_attempt_this_coordinator_started_is_the_jobs_own_fault() -> None:
    core, assigns = taken_back(RESTART)
    core.on_join("b", resumed_join("b", assigns["b"]), 100.2)
    core.on_fault("a", {"attempt": 3, "fault": dict(FAULT, rank=0)}, 101)
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    next_assigns(core, 102.1)  # attempt 4: its store opened by this coordinator
    core.on_fault("b", {"attempt": 4, "fault": STORE_LOST}, 103)
    assert core.attempt.faults and not core.attempt.planned


def test_every_node_finished_while_the_coordinator_was_away_ends_the_job() -> None:
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    core.on_join("a", resumed_join("a", assigns["a"], state="finished"), 100)
    assert core.phase is Phase.RUNNING
    outs = core.on_join("b", resumed_join("b", assigns["b"], state="finished"), 100.2)
    ends = [o for o in outs if isinstance(o, Finish)]
    assert core.phase is Phase.DONE and [o.exit_code for o in ends] == [0]


def test_a_stop_the_old_coordinator_began_is_finished_and_restores_from_memory() -> None:
    """The coordinator died between a restart's stop and the next assign: both nodes stopped
    their workers, keeping snapshots; the restart goes on, restoring the step both hold."""
    assigns = first_assigns()
    decider = ScriptedDecider(RESTART)
    core = JobCore(spec(), decider, now=100)
    core.on_join("a", resumed_join("a", assigns["a"], state="stopped", faults=[dict(FAULT, rank=0)],
                                   snapshots={"0": [8, 9], "1": [8, 9]}), 100)
    assert core.phase is Phase.STOPPING and "rank 0" in core.attempt.stop_reason
    core.on_join("b", resumed_join("b", assigns["b"], state="stopped", snapshots={"2": [8, 9], "3": [9]}), 100.3)
    assert core.phase is Phase.WAITING and len(decider.seen) == 1
    new = next_assigns(core, 100.4)
    assert {a["restore_step"] for a in new.values()} == {9} and {a["attempt"] for a in new.values()} == {4}


def test_a_node_on_another_attempt_makes_the_job_re_form_without_reusing_numbers_or_budget() -> None:
    """The old coordinator died between a's and b's assigns of attempt 4 (a restart, the 3rd):
    a resumed first with attempt 3. The job re-forms as attempt 5, with 3 restarts spent, and b's
    workers of attempt 4 are stopped too."""
    core, assigns = taken_back()
    outs = core.on_join("b", resumed_join("b", assigns["b"], attempt=4, restarts=3), 101)
    assert "b" in sends(outs, "welcome") and core.phase is Phase.STOPPING
    assert [o.body["attempt"] for o in outs if isinstance(o, Send) and o.kind == "stop" and o.node_id == "b"] == [4, 3]
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    core.on_stopped("b", {"attempt": 4, "snapshots": {}, "stacks": {}}, 102)  # its own workers': not this stop's
    assert core.phase is Phase.STOPPING
    core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 102)
    assert core.history == [] and core.restarts_used == 3
    new = next_assigns(core, 102.1)
    assert {a["attempt"] for a in new.values()} == {5} and {a["restart_count"] for a in new.values()} == {3}


def test_no_decision_is_taken_before_every_node_said_what_it_did() -> None:
    """The old coordinator had stopped the attempt for b's crash and died in the backoff. a
    resumes first (stopped), so the stop goes out again; b's plain answer to it is turned away
    until b resumes with its fault, which the decision then sees."""
    assigns = first_assigns()
    decider = ScriptedDecider(RESTART)
    core = JobCore(spec(), decider, now=100)
    core.on_join("a", resumed_join("a", assigns["a"], state="stopped"), 100)
    assert core.phase is Phase.STOPPING and core.awaits_resume("b")
    assert "unknown_job" in sends(core.on_unresumed("b", {}, 100.1), "reject")["b"]
    core.on_join("b", resumed_join("b", assigns["b"], state="stopped", faults=[FAULT]), 100.3)
    assert core.phase is Phase.WAITING
    assert [[f["message"] for f in faults] for faults in decider.seen] == [[FAULT["message"]]]


def test_spares_beyond_the_jobs_size_are_turned_out_when_it_is_taken_back() -> None:
    """A fixed 2-node job: spare c asked for a place while the coordinator was down, and its join
    made the job first. Taking the attempt of a and b back leaves no room: c asks again."""
    assigns = first_assigns()
    core = JobCore(spec(), ScriptedDecider(), now=100)
    core.on_join("c", join("c"), 100)
    outs = core.on_join("a", resumed_join("a", assigns["a"]), 100.2)
    assert sends(outs, "reject")["c"]["fenced"] is True and not sends(outs, "stop")
    assert core.phase is Phase.RUNNING and [n.node_id for n in core.members.active()] == ["a", "b"]


def test_a_resume_with_odd_fault_fields_is_taken_without_them() -> None:
    """Acceptance 29B F1: a fault the classifier cannot read failed the job when the stop was
    decided; it is left out, as a ``fault`` message of it is dropped, and the resume is taken."""
    core, assigns = taken_back(RESTART)
    odd = [{"kind": ["exit"], "rank": {"r": 1}, "ts": None, "message": 7}, {"kind": "martian", "ts": 1.0},
           {"kind": "exit", "ts": 1.0, "gpu": "x"}, {"kind": "hang", "ts": 1.0, "culprit_ranks": [None]}]
    outs = core.on_join("b", resumed_join("b", assigns["b"], faults=odd), 101)
    assert "b" in sends(outs, "welcome") and core.phase is Phase.RUNNING and not core.awaits_resume("b")
    assert core.attempt is not None and core.attempt.faults == []
    good = {"kind": "exit", "ts": 1.0, "rank": 2, "exitcode": 1}
    core, assigns = taken_back(RESTART)
    core.on_join("b", resumed_join("b", assigns["b"], faults=[*odd, good]), 101)
    assert core.phase is Phase.STOPPING and [f["kind"] for f in core.attempt.faults] == ["exit"]


def test_a_resume_from_a_node_outside_the_attempt_joins_it_as_a_late_joiner() -> None:
    core, assigns = taken_back()
    core.on_join("b", resumed_join("b", assigns["b"]), 101)
    elastic = JobCore(spec(1, 3), ScriptedDecider(), now=100)
    body = dict(resumed_join("a", assigns["a"]), min_nodes=1, max_nodes=3)
    elastic.on_join("a", body, 100)
    other = dict(resumed_join("c", dict(assigns["a"], nodes=[["c", "h-c"]], local_world_sizes=[2])),
                 min_nodes=1, max_nodes=3)
    outs = elastic.on_join("c", other, 100.5)
    assert "c" in sends(outs, "welcome") and elastic.phase is Phase.STOPPING and elastic.attempt.scale_up


@pytest.mark.parametrize("garbage, why", [
    ("x", "not an object"),
    ({"attempt": -1}, "attempt"),
    ({"nodes": [["b", "h-b"], ["c", "h-c"]]}, "leave out the node"),
    ({"nodes": [["a", "h-a"], ["a", "h-a"]], "local_world_sizes": [2, 2]}, "repeat"),
    ({"local_world_sizes": [2]}, "local_world_sizes"),
    ({"state": "sleeping"}, "state"),
    ({"faults": ["boom"]}, "faults"),
    ({"restarts_used": True}, "restarts_used"),
    ({"surprise": 1}, "unexpected"),
    ({"store_untouched": "yes"}, "store_untouched"),
    ({"master_port": 70000}, "master_port"),
    ({"master_addr": 7}, "master_addr"),
])
def test_a_resume_that_does_not_add_up_is_refused_with_the_reason(garbage: Any, why: str) -> None:
    good = resumed_join("a", first_assigns()["a"])["resume"]
    raw = dict(good, **garbage) if isinstance(garbage, dict) else garbage
    problem = parse_resume(raw, "a")
    assert isinstance(problem, str) and why in problem
    core = JobCore(spec(), ScriptedDecider(), now=0)
    outs = core.on_join("a", dict(join("a"), resume=raw), 0)
    assert "cannot take the job back" in sends(outs, "reject")["a"]["reason"] and core.attempt is None


def test_the_agent_resumes_only_as_a_member_and_before_any_assign_joins_plainly() -> None:
    state = JoinState("tcp://c:1", 60, 0)
    state.on_welcome()
    assert state.on_reject({"reason": "no job 'j' here", "unknown_job": True}) is Refusal.UNKNOWN
    made = []
    state.fenced(Resume(lambda: made.append(1) or {"resume": {}}), 1, 15)
    assert not state.welcomed and state.join_fields() == {"resume": {}} and state.join_fields() and len(made) == 2
    # More refusals of messages sent before the resume went out: the join's answer decides.
    assert state.on_reject({"reason": "no job 'j' here", "unknown_job": True}) is Refusal.STALE
    assert resume_fields(None, epoch=1, state="running", faults=[], snapshots={}, snapshot_bytes={}) == {}


def test_the_budget_spent_before_the_restart_still_counts() -> None:
    """The restarted coordinator's decider has no history: the budget spent that the resume
    carries must count all the same (found in acceptance: a job with --max-restarts 1 restarted
    twice across a coordinator restart)."""
    from unicron.coord.decide import DetectDecider

    assigns = first_assigns()
    core = JobCore(spec(), DetectDecider(), now=100)  # --max-restarts 3
    core.on_join("a", resumed_join("a", assigns["a"], restarts=3), 100)
    core.on_join("b", resumed_join("b", assigns["b"], restarts=3), 100.1)
    fault = dict(FAULT, exitcode=-9, signal=9, message="rank 2 killed by SIGKILL", progress=20)
    core.on_fault("b", {"attempt": 3, "fault": fault}, 102)
    core.on_stopped("a", {"attempt": 3, "snapshots": {}, "stacks": {}}, 103)
    outs = core.on_stopped("b", {"attempt": 3, "snapshots": {}, "stacks": {}}, 103)
    assert core.phase is Phase.FAILED, core.final_reason
    assert "restart budget spent: 3 of 3" in core.final_reason and [o for o in outs if isinstance(o, Finish)]


def test_a_job_taken_back_keeps_its_age_and_its_restarts_for_status() -> None:
    # The first coordinator restarts the job once; its next assign carries the job's start and
    # that restart, and the coordinator that takes the job back shows both (not its own start).
    old = JobCore(spec(), ScriptedDecider(RESTART), now=10)
    old.on_join("a", join("a"), 10)
    old.on_join("b", join("b"), 10)
    started(old, 11)
    old.on_fault("b", {"attempt": 0, "fault": FAULT}, 20)
    old.on_stopped("a", {"attempt": 0, "snapshots": {}, "stacks": {}}, 21)
    old.on_stopped("b", {"attempt": 0, "snapshots": {}, "stacks": {}}, 21)
    assigns = next_assigns(old, 21.5)
    assert assigns["a"]["started_at"] == 10 and len(assigns["a"]["restarts"]) == 1
    assert all(schema_errors("assign", body) is None for body in assigns.values())
    body = dict(join("a"), **resume_fields(assigns["a"], epoch=7, state="running", faults=[], snapshots={},
                                           snapshot_bytes={}))
    core = JobCore(spec(), ScriptedDecider(), now=500)
    core.on_join("a", body, 500)
    view = core.snapshot()
    assert view["job"]["started_at"] == 10 and view["job"]["attempt"] == 1 and view["job"]["restarts"] == 1
    assert view["restarts"] == old.snapshot()["restarts"] and view["restarts"][0]["attempt"] == 1


@pytest.mark.parametrize("bad", [{"started_at": "yesterday"}, {"started_at": float("nan")}, {"restarts": {}},
                                 {"restarts": [{"attempt": 1, "ts": 2.0, "cause": "c", "severity": "SEV2",
                                                "action": "restart"}]},
                                 {"restarts": [{"attempt": True, "ts": 2.0, "cause": "c", "severity": "SEV2",
                                                "action": "restart", "rule": "r"}]}])
def test_a_resume_with_a_malformed_age_or_history_is_refused(bad: dict[str, Any]) -> None:
    raw = resumed_join("a", first_assigns()["a"])["resume"]
    assert isinstance(parse_resume(dict(raw, **bad), "a"), str)


@pytest.mark.timeout(60)
def test_a_restarted_coordinator_lets_no_plain_join_create_a_job_its_members_may_resume(tmp_path) -> None:
    """Acceptance 29B F2: a replacement node's plain join reached a restarted standalone
    coordinator before the survivors' resume, and created the job anew: attempt 0 again, the
    restart budget whole, the survivor fenced. Within a heartbeat timeout of its start, a
    coordinator tells such a join to ask again; a resume takes the job back meanwhile."""
    from e2e import wait_for

    from unicron.coord.decide import DetectDecider
    from unicron.coord.server import CoordinatorServer
    from unicron.events import EventLog
    from unicron.proto.client import request

    key = b"k" * 32
    events = EventLog(tmp_path / "events.jsonl", job="job")
    server = CoordinatorServer(key, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider)
    server.start()
    ep = f"127.0.0.1:{server.port}"

    def ask(body: dict[str, Any], job: str = "job") -> Any:
        return request(ep, "join", body, job=job, key=key, timeout_s=5)

    try:
        held = ask(join("c"))
        assert held.kind == "reject" and held.body.get("wait") is True, held.body
        assert "members that long to resume it" in held.body["reason"] and "job" not in server.slots
        # The same words each time: the agent says a refusal once per distinct reason.
        assert ask(join("c")).body["reason"] == held.body["reason"]
        assigns = first_assigns()
        assert ask(resumed_join("a", assigns["a"])).kind == "welcome"
        core = server.slots["job"].core
        assert core.attempt is not None and core.attempt.number == 3 and core.restarts_used == 2
        full = ask(join("c"))  # the job lives: the replacement waits for a place as in any full job
        assert full.kind == "reject" and full.body.get("wait") is True and "full" in full.body["reason"]
        # Past the window (the joiner's heartbeat timeout, 3 s) a job nobody resumed is created.
        wait_for(lambda: ask(join("x"), job="other").kind == "welcome", 20, "a join to create a new job")
        assert server.slots["job"].core is core and core.attempt.number == 3 and set(server.slots) == {"job", "other"}
    finally:
        server.stop()
        events.close()


def test_the_resume_window_is_a_few_heartbeats_not_a_raised_heartbeat_timeout() -> None:
    from unicron.coord.resume import resume_window

    # A raised --heartbeat-timeout (30 s) held every new job on a fresh coordinator 30 s (30B F4).
    held = dict(join("c"), heartbeat_timeout_s=30.0, heartbeat_interval_s=0.5)
    assert resume_window(3.4, "job", held) is not None and resume_window(3.6, "job", held) is None
    default = dict(join("c"), heartbeat_timeout_s=3.0, heartbeat_interval_s=0.5)
    assert resume_window(2.9, "job", default) is not None and resume_window(3.1, "job", default) is None
    assert resume_window(0.1, "job", dict(default, resume={})) is None  # a resume is never held
