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


def test_a_coordinator_silent_over_an_open_connection_to_a_host_that_answers_gets_longer() -> None:
    """Its process lives (stopped, swapping): 4 x the silence of a closed one, except for a node
    whose workers all finished, which only waits for the job's end. Open but with a host that
    does not answer (a partition, the host frozen whole or gone): the short limit."""
    c = link()
    c.heard(10.0)
    c.connection(True)
    assert not c.probing(10.9) and c.probing(11.1)  # two answers missed
    assert c.limit_s(11.0) == 15.0 and c.lost(25.1)  # nothing known of its host yet
    for t in range(12, 70):
        c.host_answered(float(t))  # the probe connects once a second
        assert not c.lost(t + 0.5)
    assert c.limit_s(69.0) == 60.0 and c.lost(70.1)
    assert c.limit_s(69.0, done=True) == 15.0 and c.lost(25.1, done=True)
    assert c.limit_s(73.9) == 60.0 and c.limit_s(74.1) == 15.0  # its host has not answered for 5 s
    c.connection(False)  # its host's kernel closed the connection: the process died
    assert c.limit_s(69.0) == 15.0 and c.lost(25.1) and not c.probing(30.0)


def test_a_partitioned_coordinator_is_given_up_after_the_short_limit() -> None:
    c = link()
    c.heard(10.0)
    c.connection(True)
    c.host_answered(4.0)  # an earlier silence's answer is stale
    assert not c.lost(24.9) and c.lost(25.1) and not c.lives_unheard(25.1)


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


def test_a_coordinator_that_hears_no_other_node_holds_hang_calls_and_the_time_is_excused_after() -> None:
    """Its acks say ``deaf`` (its own link is likelier cut): this node's ranks wait on ranks it
    cannot hear, so no hang is called, and that time comes off the hang clocks when it ends."""
    c = link(10.0)

    def acks(start: float, end: float, deaf: bool) -> float:  # one every 0.5 s, as heartbeats are answered
        excused, t = 0.0, start
        while t <= end:
            assert c.heard(t) == 0.0  # the coordinator itself is heard all along
            excused += c.told_deaf(t, deaf)
            t += 0.5
        return excused

    assert acks(10.5, 10.5, False) == 0.0 and not c.unheard(10.5)
    assert acks(11.0, 14.0, True) == 0.0 and c.unheard(14.0)
    c.paused(1.0)  # this agent's own stall is excused by itself, not twice
    assert acks(15.5, 16.5, True) == 0.0 and c.unheard(16.5)
    assert acks(17.0, 17.0, False) == 5.0 and not c.unheard(17.0)  # 6 s deaf, 1 of them paused
    acks(18.0, 18.0, True)
    assert c.unheard(27.9) and not c.unheard(28.1)  # 15 s an attempt at most: 5 spent
    assert c.told_deaf(40.0, False) == 10.0


def test_the_endpoints_address() -> None:
    from unicron.agent.hostprobe import tcp_address

    assert tcp_address("tcp://10.0.0.2:29500") == ("10.0.0.2", 29500)
    assert tcp_address("tcp://[::1]:5") == ("::1", 5) and tcp_address("tcp://node-3.cluster:80") == ("node-3.cluster", 80)
    for other in ("ipc:///tmp/x", "tcp://host", "tcp://:5", "tcp://h:p"):
        assert tcp_address(other) is None


@pytest.mark.timeout(60)
def test_the_probe_finds_a_stopped_process_up_and_a_closed_port_not() -> None:
    """A coordinator's process stopped with SIGSTOP: its host's kernel still accepts connections
    on its port (into the listen backlog), so the probe says up; a port nobody listens on: no."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from e2e import wait_for as until

    from unicron.agent.hostprobe import HostProbe

    server = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: a connect is refused
    up = down = None
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        server.send_signal(signal.SIGSTOP)
        up = HostProbe(f"tcp://127.0.0.1:{port}", every_s=0.1, timeout_s=1.0)
        down = HostProbe(f"tcp://127.0.0.1:{closed.getsockname()[1]}", every_s=0.1, timeout_s=1.0)
        assert up.answered_at is None and up.probes == 0
        up.want(True)
        down.want(True)
        until(lambda: up.answered_at is not None and down.probes >= 3, 20, "probes")
        assert down.answered_at is None
        up.want(False)  # asked to stop: at most the probe in flight, then none

        def probes_stopped() -> bool:
            before = up.probes
            time.sleep(0.5)  # one sampling window of the poll: five probe periods
            return up.probes == before

        until(probes_stopped, 10, "the probes to stop")
    finally:
        for probe in (up, down):
            if probe is not None:
                probe.close()
        closed.close()
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
