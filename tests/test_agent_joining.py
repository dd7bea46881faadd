"""The agent's side of membership (``unicron.agent.joining``), driven with a fake clock."""

from __future__ import annotations

import pytest

from unicron.agent.joining import JOIN_RETRY_S, QUIET_NOTICE_S, JoinState, Refusal, Rejoin
from unicron.errors import RendezvousError


def test_a_join_goes_out_at_once_then_every_retry_until_welcomed() -> None:
    j = JoinState("tcp://h:1", join_timeout_s=10, now=100.0)
    assert j.join_due(100.0)
    assert not j.join_due(100.0 + JOIN_RETRY_S / 2)
    assert j.join_due(100.0 + JOIN_RETRY_S)
    assert j.on_welcome() is None and j.welcomed
    assert not j.join_due(200.0)  # a member joins no more, whatever the time


def test_no_answer_within_the_join_timeout_ends_the_agent() -> None:
    j = JoinState("tcp://h:1", join_timeout_s=3, now=0.0)
    assert j.join_due(0.0)
    with pytest.raises(RendezvousError, match="no coordinator answered at tcp://h:1 within 3 s"):
        j.join_due(3.5)


def test_a_join_unanswered_for_a_while_is_told_once() -> None:
    j = JoinState("tcp://h:1", join_timeout_s=600, now=0.0)
    assert j.quiet_notice(QUIET_NOTICE_S - 0.1) is None
    notice = j.quiet_notice(QUIET_NOTICE_S)
    assert notice is not None and "tcp://h:1 after 10 s" in notice and "UNICRON_SECRET" in notice
    assert j.quiet_notice(QUIET_NOTICE_S + 50) is None  # once
    short = JoinState("tcp://h:1", join_timeout_s=8, now=0.0)  # half a short join timeout
    assert short.quiet_notice(3.9) is None and short.quiet_notice(4.0) is not None
    welcomed = JoinState("tcp://h:1", join_timeout_s=600, now=0.0)
    welcomed.on_welcome()
    assert welcomed.quiet_notice(100.0) is None


def test_refusals_of_a_join_end_the_agent_with_the_reason() -> None:
    j = JoinState("tcp://h:1", join_timeout_s=3, now=0.0)
    with pytest.raises(RendezvousError, match="job j is over"):
        j.on_reject({"reason": "job j is over"})
    with pytest.raises(RendezvousError, match="--nnodes mismatch"):
        j.on_reject({"reason": "--nnodes mismatch: this node says 2:2, the job is 3:3", "wait": False})
    # "fenced" from a node that never was a member is a refusal like any other
    with pytest.raises(RendezvousError, match="not a member"):
        j.on_reject({"reason": "not a member of the job", "fenced": True})


def test_a_fenced_member_joins_again_at_once_carrying_what_it_kept() -> None:
    j = JoinState("tcp://h:1", join_timeout_s=5, now=0.0)
    j.join_due(0.0)
    j.on_welcome()
    assert j.on_reject({"reason": "declared lost", "fenced": True}) is Refusal.FENCED
    kept = Rejoin(3, {"1": [6, 7]}, {"7": 4096})
    j.fenced(kept, now=50.0, timeout_s=15.0)
    assert not j.welcomed and j.join_due(50.0)
    assert j.join_fields() == {"attempt": 3, "snapshots": {"1": [6, 7]}, "snapshot_bytes": {"7": 4096}}
    # A heartbeat sent before the fence is answered "fenced" again: stale, not a second fence.
    assert j.on_reject({"reason": "declared lost", "fenced": True}) is Refusal.STALE
    with pytest.raises(RendezvousError, match="is over"):  # the job ended meanwhile
        j.on_reject({"reason": "job x is over"})
    assert j.on_welcome() == kept and j.join_fields() == {}
    # The join timeout starts over with the re-join.
    # The re-join waits as long as a live coordinator could take to answer, not a job's start.
    j2 = JoinState("tcp://h:1", join_timeout_s=600, now=0.0)
    j2.on_welcome()
    j2.fenced(Rejoin(None, {}, {}), now=100.0, timeout_s=15.0)
    assert j2.join_due(114.0) and j2.join_fields() == {"snapshots": {}, "snapshot_bytes": {}}
    with pytest.raises(RendezvousError, match="within 15 s"):
        j2.join_due(116.0)


@pytest.mark.timeout(10)
def test_a_rejoining_node_refused_as_full_waits_the_join_timeout_not_the_short_rejoin_limit() -> None:
    """Acceptance 29B F3: a fenced (or resuming) node refused as "job is full" gave up after the
    re-join's 15 s, not the join timeout the docs promise for a full job. The 15 s is for a
    coordinator that does not answer at all."""
    j = JoinState("tcp://h:1", join_timeout_s=600, now=0.0)
    j.on_welcome()
    j.fenced(Rejoin(None, {}, {}), now=100.0, timeout_s=15.0)
    full = {"reason": "job is full: 2 node(s) already joined", "wait": True}
    for now in range(100, 690):
        if j.join_due(float(now)):
            j.heard(float(now))
            assert j.on_reject(full) is Refusal.WAIT
    notice = j.waiting_notice(full["reason"])
    assert notice is not None and "for up to 600 s" in notice
    with pytest.raises(RendezvousError, match="refused this node for 600 s: job is full"):
        j.join_due(701.0)
    quiet = JoinState("tcp://h:1", join_timeout_s=600, now=0.0)  # told to wait, then no answer at all
    quiet.on_welcome()
    quiet.fenced(Rejoin(None, {}, {}), now=100.0, timeout_s=15.0)
    assert quiet.join_due(100.0)
    quiet.heard(100.0)
    quiet.on_reject(full)
    quiet.waiting_notice(full["reason"])
    with pytest.raises(RendezvousError, match="stopped answering"):
        quiet.join_due(116.0)


def test_a_full_job_is_waited_out_until_a_place_frees_or_the_join_timeout() -> None:
    # A crashed node's replacement may ask before the crash is noticed: "full" is for now.
    j = JoinState("tcp://h:1", join_timeout_s=20, now=0.0)
    assert j.join_due(0.0)
    full = {"reason": "job is full: 2 node(s) already joined", "wait": True}
    assert j.on_reject(full) is Refusal.WAIT
    notice = j.waiting_notice(full["reason"])
    assert notice is not None and "no place for this node yet (job is full: 2 node(s) already joined)" in notice
    assert j.waiting_notice(full["reason"]) is None  # said once
    assert j.quiet_notice(15.0) is None  # it did answer: no "no answer yet"
    assert not j.join_due(0.5) and j.join_due(1.0)  # still asking, every second
    assert j.on_reject(full) is Refusal.WAIT
    j.on_welcome()  # a member was lost: the next join got its place
    assert j.welcomed and j.refused is None
    late = JoinState("tcp://h:1", join_timeout_s=20, now=0.0)
    late.on_reject(full)
    late.waiting_notice(full["reason"])
    with pytest.raises(RendezvousError, match=r"refused this node for 20 s: job is full"):
        late.join_due(20.5)



def test_a_node_waiting_for_a_place_ends_once_the_coordinator_stops_answering() -> None:
    """It answered "full, wait" to every join; then silence (the job ended, the coordinator's
    launcher exited): the waiting node ends after the silence a member would take for a lost
    coordinator, not after the whole join timeout."""
    j = JoinState("tcp://h:1", join_timeout_s=600, now=0.0, gone_after_s=15.0)
    full = {"reason": "job is full: 2 node(s) already joined", "wait": True}
    for t in range(0, 30):
        if j.join_due(float(t)):
            j.heard(t + 0.01)
            assert j.on_reject(full) is Refusal.WAIT
            j.waiting_notice(full["reason"])
    assert j.heard_at == 29.01
    assert j.join_due(30.0) and not j.join_due(30.5)  # still asking, every second
    assert j.join_due(43.9)  # 14.9 s without an answer
    with pytest.raises(RendezvousError, match=r"stopped answering while this node waited for a place \(job is "
                                              r"full: 2 node\(s\) already joined\): no answer for 15 s"):
        j.join_due(44.1)
    never = JoinState("tcp://h:1", join_timeout_s=600, now=0.0, gone_after_s=15.0)
    assert never.join_due(0.0) and never.join_due(16.0)  # never answered: the coordinator may start later


def test_role_ranks_count_the_workers_of_nodes_of_the_same_role_before_this_one() -> None:
    from unicron.agent.attempt import role_ranks

    body = {"local_world_sizes": [2, 3, 1, 2], "roles": ["t", "e", "t", "e"], "node_rank": 2}
    assert role_ranks(body) == {"role_offset": 2, "role_world_size": 3}
    assert role_ranks(dict(body, node_rank=3)) == {"role_offset": 3, "role_world_size": 5}
    # None sent, or not one per node (a peer's message: anything may come): the global ones.
    assert role_ranks(dict(body, roles=None)) == {} and role_ranks(dict(body, roles=["t"])) == {}


def test_a_lost_coordinators_line_names_the_root_cause_the_node_reported_not_its_first_report() -> None:
    """27B F6's line names what this node reported; CI found the race in its e2e: the peer
    that lost its connection to the killed rank reported first, and was named."""
    from unicron.agent.rejoin import reported

    victim = {"kind": "exception", "rank": 1, "error_type": "RuntimeError", "ts": 1.0, "steps_completed": 5,
              "message": "[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer", "attempt": 0}
    killed = {"kind": "exit", "rank": 0, "exitcode": -9, "summary": "signal SIGKILL (9)", "ts": 1.5,
              "steps_completed": 5, "attempt": 0}
    assert reported([victim, killed]) == "; before it, this node reported exit on rank 0 at step 5: signal SIGKILL (9)"
    assert reported([victim]).startswith("; before it, this node reported exception on rank 1 at step 5: RuntimeError")
    assert reported([{"kind": "health", "ts": 1.0}]) == "" and reported([]) == ""


def test_a_node_with_no_attempt_yet_does_not_say_its_workers_train_on_when_the_coordinator_restarted(
        tmp_path) -> None:
    # 30B F5: a node that had joined but had no attempt said "joining it again with the running
    # attempt, the workers train on" after a coordinator restart: it had neither.
    from unicron.agent.link import CoordinatorLink
    from unicron.agent.rejoin import Rejoiner
    from unicron.events import EventLog

    said: list[str] = []

    class UI:
        def warn(self, text: str) -> None:
            said.append(text)

    events = EventLog(tmp_path / "events.jsonl", job="j")
    rejoiner = Rejoiner(JoinState("tcp://h:1", join_timeout_s=600, now=0.0),
                        CoordinatorLink(0.0, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0),
                        endpoint="tcp://h:1", shm_dir=str(tmp_path), ui=UI(), events=events)
    rejoiner.resume("unknown job", None, dict)
    rejoiner.resume("unknown job", 3, dict)
    events.close()
    assert said[0].endswith("(unknown job: it restarted?); joining it again"), said
    assert said[1].endswith("joining it again with the running attempt, the workers train on"), said
