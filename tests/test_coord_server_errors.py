"""A bug in one job's turn of the coordinator's real loop ends that job with its cause; the loop
serves on (it used to end the serving thread, and every job then waited without a word)."""

from __future__ import annotations

import pytest

from unicron.coord.decide import DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.server import CoordinatorServer
from unicron.events import EventLog
from unicron.proto.client import request

KEY = b"k" * 32
pytestmark = pytest.mark.timeout(60)


def _join(node: str) -> dict:
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 1,
            "max_nodes": 1, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": 30,
            "join_timeout_s": 60, "stop_timeout_s": 5}


def test_an_error_starting_an_attempt_fails_that_job_and_the_loop_serves_on(tmp_path, monkeypatch) -> None:
    def broken(self, master_addr: str, master_port: int, now: float) -> list:
        raise RuntimeError("boom")

    monkeypatch.setattr(JobCore, "start_attempt", broken)
    events = EventLog(tmp_path / "events.jsonl", job="a")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"a", "b"})
    server.start()
    try:
        ep = f"127.0.0.1:{server.port}"
        request(ep, "join", _join("n1"), job="a", key=KEY, timeout_s=10, expect="welcome")
        # The store opens in its own thread; starting the attempt then fails: the job says why.
        told = request(ep, "heartbeat", {"node_id": "n1", "epoch": 0, "attempt": -1, "workers": [], "health": {}},
                       job="a", key=KEY, timeout_s=20, expect="shutdown")
        assert told.body["exit_code"] == 1 and told.body["reason"] == "coordinator error: RuntimeError: boom"
        # Still serving: another job is welcomed.
        request(ep, "join", _join("n2"), job="b", key=KEY, timeout_s=10, expect="welcome")
        assert server.thread is not None and server.thread.is_alive()
    finally:
        server.stop()
        events.close()
