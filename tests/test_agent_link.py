"""What an agent knows of its coordinator (``unicron.agent.link``), with a fake clock."""

from __future__ import annotations

import pytest

from unicron.agent.link import CoordinatorLink
from unicron.detect.activity import Activity


def link(now: float = 0.0) -> CoordinatorLink:
    return CoordinatorLink(now, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0)


def test_silence_past_the_deadline_is_a_lost_coordinator() -> None:
    c = link()
    assert c.lost_after_s == 15.0  # max(5 x 3 s, 15 s)
    assert CoordinatorLink(0, heartbeat_interval_s=1, heartbeat_timeout_s=10).lost_after_s == 50.0
    c.heard(10.0)
    assert not c.lost(24.9) and c.lost(25.1)


def test_time_the_agent_did_not_listen_is_nobodys_silence() -> None:
    c = link()
    c.heard(10.0, Activity.IDLE)
    c.paused(20.0)  # the agent was stopped: the answers wait in its socket
    assert not c.lost(44.0) and c.job_level(30.2) is Activity.IDLE


def test_steps_of_this_nodes_ranks_are_signs_of_life() -> None:
    """The coordinator's launcher is stopped, but the ranks step: every collective spans its
    node too, so the job lives."""
    c = link()
    c.heard(10.0)
    assert not c.lost(40.0, stepped_at=39.5)
    assert c.silent_s(40.0, stepped_at=5.0) == 30.0  # an old step does not make the silence shorter
    assert c.lost(40.0, stepped_at=None)


def test_the_jobs_level_goes_stale_after_two_missed_answers() -> None:
    c = link()
    assert c.job_level(0.0) is Activity.BUSY  # nothing heard yet: the safe side
    c.heard(1.0, Activity.IDLE)
    assert c.job_level(1.9) is Activity.IDLE
    assert c.job_level(2.1) is Activity.BUSY  # under the 1.5 s idle floor: a frozen coordinator's node
    c.heard(3.0, Activity.WORKING)
    assert c.job_level(3.1) is Activity.WORKING and c.job_level(9.0) is Activity.WORKING
    c.heard(9.5)  # a message without a level does not refresh it
    assert c.job_level(9.6) is Activity.WORKING


def test_a_coordinator_silent_over_an_open_connection_gets_longer() -> None:
    """Its process lives (stopped, or its node frozen whole): 4 x the silence of a closed one,
    except for a node whose workers all finished, which only waits for the job's end."""
    c = link()
    c.heard(10.0)
    c.connection(True)
    assert c.limit_s() == 60.0 and not c.lost(69.0) and c.lost(70.1)
    assert c.limit_s(done=True) == 15.0 and c.lost(25.1, done=True)
    c.connection(False)  # its host's kernel closed the connection: the process died
    assert c.lost(25.1)


@pytest.mark.timeout(30)
def test_the_socket_monitor_sees_the_session_open_and_close() -> None:
    import zmq
    from e2e import wait_for as until

    from unicron.agent.connwatch import ConnectionWatch

    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    watch = ConnectionWatch(dealer)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        states: list[bool] = []

        def seen(want: bool) -> bool:
            if watch.sock.poll(50):
                up = watch.read()
                if up is not None:
                    states.append(up)
            return bool(states) and states[-1] is want

        until(lambda: seen(True), 10, "the session to open")
        router.close(linger=0)  # the coordinator's process is gone
        until(lambda: seen(False), 10, "the session to close")
    finally:
        watch.close()
        dealer.close(linger=0)
        if not router.closed:
            router.close(linger=0)


def test_silence_is_excused_from_hang_clocks_only_for_a_coordinator_that_hosts_ranks_and_only_so_much() -> None:
    c = link(10.0)
    assert not c.unheard(10.9) and c.unheard(11.1) and c.heard(20.0) == 9.0  # 10 s of silence, less the 1 s of two answers
    # An answer every 14 s (over a closed connection: 15 s limit) excuses at most 15 s an attempt.
    assert c.unheard(34.5) and c.heard(34.5) == 6.0  # 15 - 9 left
    assert not c.unheard(50.0) and c.heard(50.0) == 0.0
    c.new_attempt()
    assert c.unheard(52.0)
    alone = CoordinatorLink(0, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, hosts_ranks=False)
    assert not alone.unheard(10.0) and alone.heard(10.0) == 0.0  # a standalone coordinator runs no ranks
