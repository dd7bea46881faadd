"""A bug in one job's turn of the coordinator's real loop ends that job with its cause; the loop
serves on (it used to end the serving thread, and every job then waited without a word)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import zmq
from e2e import wait_for

from unicron.coord.decide import DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.server import CoordinatorServer
from unicron.errors import EndpointUnreachableError
from unicron.events import EventLog
from unicron.proto.client import request
from unicron.proto.messages import Codec

KEY = b"k" * 32
pytestmark = pytest.mark.timeout(60)


@contextmanager
def _served(tmp_path, jobs: set[str] | None, **kwargs: Any) -> Iterator[tuple[CoordinatorServer, str]]:
    """A real coordinator in this process, serving ``jobs`` (None: any), and its endpoint."""
    events = EventLog(tmp_path / "events.jsonl", job="a")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs=jobs, **kwargs)
    server.start()
    try:
        yield server, f"127.0.0.1:{server.port}"
    finally:
        server.stop()
        events.close()


def _join(node: str) -> dict:
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 1,
            "max_nodes": 1, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": 30,
            "join_timeout_s": 60, "stop_timeout_s": 5}


def test_an_error_starting_an_attempt_fails_that_job_and_the_loop_serves_on(tmp_path, monkeypatch) -> None:
    def broken(self, master_addr: str, master_port: int, now: float) -> list:
        raise RuntimeError("boom")

    monkeypatch.setattr(JobCore, "start_attempt", broken)
    with _served(tmp_path, {"a", "b"}) as (server, ep):
        request(ep, "join", _join("n1"), job="a", key=KEY, timeout_s=10, expect="welcome")
        # The store opens in its own thread; starting the attempt then fails: the job says why.
        told = request(ep, "heartbeat", {"node_id": "n1", "epoch": 0, "attempt": -1, "workers": [], "health": {}},
                       job="a", key=KEY, timeout_s=20, expect="shutdown")
        assert told.body["exit_code"] == 1 and told.body["reason"] == "coordinator error: RuntimeError: boom"
        # Still serving: another job is welcomed.
        request(ep, "join", _join("n2"), job="b", key=KEY, timeout_s=10, expect="welcome")
        assert server.thread is not None and server.thread.is_alive()


def test_a_standalone_coordinator_starts_a_failed_jobs_id_again_but_not_a_finished_ones(tmp_path) -> None:
    """Acceptance 21B F2: a preempted Slurm job is requeued with its SLURM_JOB_ID (the job id):
    its fresh launchers were refused (`job ... is over`) for the coordinator's life. A job that
    failed or was interrupted is started again, as torchrun's rendezvous stays open then; one
    that finished is over, as torchrun's is closed."""
    with _served(tmp_path, None) as (server, ep):
        server.started_at -= 60  # up for a while: no job of its may be waiting for its members to resume it
        def attempt_of(node: str) -> int:  # joined, it is assigned the job's attempt (one node is enough)
            request(ep, "join", _join(node), job="a", key=KEY, timeout_s=10, expect="welcome")
            heartbeat = {"node_id": node, "epoch": 0, "attempt": -1, "workers": [], "health": {}}
            return int(request(ep, "heartbeat", heartbeat, job="a", key=KEY, timeout_s=20, expect="assign")
                       .body["attempt"])

        attempt_of("n1")
        request(ep, "fault", {"node_id": "n1", "attempt": 0, "fault": {"kind": "exit", "ts": 1.0, "rank": 0,
                                                                          "attempt": 0, "exitcode": 1}},
                job="a", key=KEY, timeout_s=10, expect="stop")  # no restart allowed: the job fails
        wait_for(lambda: server.slots["a"].finished_at is not None, 20, "the job to fail")
        assert server.slots["a"].core.exit_code != 0
        # Its launchers again (no resume: fresh ones): a new job of that id, which can finish.
        attempt = attempt_of("n2")
        request(ep, "finished", {"node_id": "n2", "attempt": attempt}, job="a", key=KEY, timeout_s=10,
                expect="shutdown")
        assert server.slots["a"].core.exit_code == 0
        refused = request(ep, "join", _join("n3"), job="a", key=KEY, timeout_s=10, expect="reject")
        assert "is over" in refused.body["reason"]


def test_a_join_of_another_job_on_an_embedded_coordinators_endpoint_is_told_why_at_once(tmp_path) -> None:
    """Acceptance 21B F1: a second job's nodes on the same endpoint waited out the join timeout
    (600 s), told to check their secret. Signed with the job's secret, they are told at once."""
    with _served(tmp_path, {"a"}) as (_, ep):
        told = request(ep, "join", _join("n9"), job="b", key=KEY, timeout_s=10, expect="reject")
        assert "is job 'a''s" in told.body["reason"] and "another --rdzv-endpoint" in told.body["reason"]
        assert "wait" not in told.body  # not a place to wait for: the agent ends with it
        # Another secret gets no answer (it cannot be trusted with one).
        with pytest.raises(EndpointUnreachableError):
            request(ep, "join", _join("n8"), job="b", key=b"x" * 32, timeout_s=1, expect="reject")
        request(ep, "join", _join("n1"), job="a", key=KEY, timeout_s=10, expect="welcome")


def test_a_peer_named_after_a_node_gets_nothing_meant_for_it(tmp_path) -> None:
    """Acceptance 21C F7: agents named their socket after their node id, which consoles and
    `unicron status` show. A peer without the secret that connected first under that name, as a
    restarted coordinator came up, got the messages meant for a node not heard from yet (and
    ZeroMQ shut the real one out). Now nothing goes to a name no node spoke from."""
    from test_coord_resume import first_assigns, resumed_join

    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.setsockopt(zmq.IDENTITY, b"b")  # node b's plain id
    with _served(tmp_path, None) as (_, ep):
        rogue.connect(f"tcp://{ep}")
        assigns = first_assigns()
        fault = {"kind": "exit", "rank": 2, "ts": 50.0, "message": "rank 2 exited with code 1", "exitcode": 1,
                 "attempt": 3}
        # Node a resumes the attempt with a fault: the attempt stops, and b, a node of it not
        # heard from yet, is to be told when it speaks.
        a = zmq.Context.instance().socket(zmq.DEALER)
        a.setsockopt(zmq.LINGER, 0)
        a.setsockopt(zmq.IDENTITY, b"a~0123456789abcdef")
        a.connect(f"tcp://{ep}")
        codec = Codec(KEY, "a", job="job")
        try:
            a.send(codec.encode("join", resumed_join("a", assigns["a"], faults=[fault])))
            kinds = []
            while "stop" not in kinds:
                assert a.poll(10_000), kinds
                kinds.append(codec.decode(a.recv()).kind)
            assert not rogue.poll(500)  # sent in the same turn as a's stop: nothing came
        finally:
            a.close(0)
            rogue.close(0)


def test_a_signed_message_from_another_socket_does_not_take_a_nodes_orders(tmp_path) -> None:
    """Acceptance 30B F1: one message for node a, signed with the secret, from another socket,
    made the coordinator answer a there only: a's stop (and its next assign) went to that
    socket, the job ended "failed" while a's workers trained on, or hung after training. Orders
    now go to a node's earlier sockets too."""
    ctx = zmq.Context.instance()
    a = ctx.socket(zmq.DEALER)
    other = ctx.socket(zmq.DEALER)
    with _served(tmp_path, {"job"}) as (_, ep):
        for sock, name in ((a, b"a~0123456789abcdef"), (other, b"a~fedcba9876543210")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, name)
            sock.connect(f"tcp://{ep}")
        codec = Codec(KEY, "a", job="job")
        try:
            a.send(codec.encode("join", dict(_join("a"), max_restarts=1)))
            seen: dict[str, dict] = {}
            hb = {"node_id": "a", "epoch": 0, "attempt": -1, "workers": [], "health": {}}

            def heard(kind: str, beat: bool = True) -> bool:
                if beat:  # a live node's heartbeats, answered on a's socket
                    a.send(codec.encode("heartbeat", hb))
                while a.poll(100):
                    msg = codec.decode(a.recv())
                    seen[msg.kind] = msg.body
                return kind in seen

            wait_for(lambda: heard("assign"), 30, "a's assign")
            attempt = seen["assign"]["attempt"]
            fault = {"kind": "exit", "rank": 0, "ts": 1.0, "exitcode": 1, "attempt": attempt}
            other.send(codec.encode("fault", {"node_id": "a", "attempt": attempt, "fault": fault}))
            # a says nothing more: its latest word came over the other socket.
            wait_for(lambda: heard("stop", beat=False), 20, "a's stop, though the fault came over another socket")
        finally:
            a.close(0)
            other.close(0)
