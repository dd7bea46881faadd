"""A coordinator that hears no node of any job (``unicron.coord.deafness``): pure, and in the
coordinator's real loop, where the silence of everyone at once is its own and loses nobody,
while one node silent among others heard is lost as before."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from e2e import wait_for

from unicron.coord.deafness import DeafWatch, allowance_s
from unicron.coord.decide import DetectDecider
from unicron.coord.server import CoordinatorServer
from unicron.events import EventLog
from unicron.proto.client import request
from unicron.proto.messages import Codec

KEY = b"k" * 32
pytestmark = pytest.mark.timeout(60)


def test_the_allowance_sits_between_a_heartbeat_gap_and_the_timeout() -> None:
    assert allowance_s(0.5, 3.0) == 2.0  # the defaults
    assert allowance_s(1.0, 5.0) == 3.0
    assert allowance_s(1.0, 3.0) is None  # no room between a heartbeat's gap and the timeout
    assert allowance_s(1.0, 1.5) is None


def test_silence_of_everyone_is_excused_past_the_allowance_until_someone_is_heard() -> None:
    deaf = DeafWatch(100.0, cap_s=60.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    assert deaf.excuse("a", 101.9, nodes=2, **hb) == 0.0  # under the allowance (2 s)
    assert not deaf.spell_started("a")
    assert deaf.excuse("a", 103.0, nodes=2, **hb) == pytest.approx(1.0)
    assert deaf.spell_started("a") and not deaf.spell_started("b")
    assert deaf.excuse("a", 103.5, nodes=2, **hb) == pytest.approx(0.5)  # only what is new
    assert deaf.excuse("b", 103.5, nodes=2, **hb) == pytest.approx(1.5)  # each job its own account
    assert deaf.deaf_s(103.5) == pytest.approx(3.5)
    assert deaf.heard(104.0) == {"a": pytest.approx(1.5), "b": pytest.approx(1.5)}
    assert deaf.excuse("a", 105.0, nodes=2, **hb) == 0.0 and deaf.heard(105.5) == {}


def test_one_nodes_silence_is_its_own_and_excuses_stop_at_the_cap() -> None:
    deaf = DeafWatch(0.0, cap_s=60.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    assert deaf.excuse("a", 10.0, nodes=1, **hb) == 0.0
    assert deaf.excuse("a", 30.0, nodes=2, **hb) == pytest.approx(28.0)
    assert deaf.excuse("a", 500.0, nodes=2, **hb) == pytest.approx(32.0)  # 60 s in all, then no more
    assert deaf.excuse("a", 900.0, nodes=2, **hb) == 0.0


def test_a_stall_of_the_coordinator_is_not_excused_twice() -> None:
    deaf = DeafWatch(0.0, cap_s=60.0)
    deaf.paused(10.0)  # the stall watch excused 10 s already
    assert deaf.excuse("a", 11.0, nodes=2, interval_s=0.5, timeout_s=3.0) == 0.0
    assert deaf.excuse("a", 13.0, nodes=2, interval_s=0.5, timeout_s=3.0) == pytest.approx(1.0)


# ---- in the real loop ------------------------------------------------------------------


def _join_body(node: str) -> dict[str, Any]:
    # Three nodes wanted: the job waits, and only the coordinator's own clock judges silence.
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 3,
            "max_nodes": 3, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": 3,
            "join_timeout_s": 60, "stop_timeout_s": 5}


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _heartbeat(sock: zmq.Socket, codec: Codec, node: str) -> None:
    sock.send(codec.encode("heartbeat", {"node_id": node, "epoch": 0, "attempt": -1, "workers": [], "health": {}}))


@pytest.fixture
def served(tmp_path: Path) -> Any:
    log = tmp_path / "events.jsonl"
    events = EventLog(log, job="j")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"})
    server.start()
    try:
        yield f"127.0.0.1:{server.port}", log
    finally:
        server.stop()
        events.close()


def test_everyone_silent_at_once_loses_nobody_and_a_node_still_silent_after_is_lost(served: Any) -> None:
    """Both nodes fall silent together (the coordinator's link cut, in life) for longer than the
    heartbeat timeout: nobody is lost. Then n1 is heard again and n2 is not: n2 is lost, n1 not."""
    ep, log = served
    for node in ("n1", "n2"):
        request(ep, "join", _join_body(node), job="j", key=KEY, timeout_s=5, expect="welcome")
    joined = time.monotonic()
    wait_for(lambda: any(e["kind"] == "coordinator_deaf" for e in _events(log)), 15, "the coordinator to say it hears nobody")
    while time.monotonic() < joined + 5:  # well past the 3 s timeout, polling its view (not heard)
        snap = request(ep, "status_req", {}, job="j", key=KEY, timeout_s=5, expect="status").body["snapshot"]
        assert {n["node_id"]: n["state"] for n in snap["nodes"]} == {"n1": "healthy", "n2": "healthy"}
        time.sleep(0.2)
    assert not [e for e in _events(log) if e["kind"] == "node_lost"]
    deaf = next(e for e in _events(log) if e["kind"] == "coordinator_deaf")
    assert deaf["nodes"] == 2 and deaf["silent_s"] >= 2.0

    codec = Codec(KEY, "n1", job="j")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"n1-{os.urandom(4).hex()}".encode())
    sock.connect(f"tcp://{ep}")
    try:
        heard_at = time.monotonic()
        _heartbeat(sock, codec, "n1")

        def n2_lost() -> Any:
            _heartbeat(sock, codec, "n1")  # n1 goes on heartbeating every 0.1 s
            time.sleep(0.1)
            return [e for e in _events(log) if e["kind"] == "node_lost"]
        lost = wait_for(n2_lost, 15, "n2 to be lost")
    finally:
        sock.close(0)
    assert [e["node_id"] for e in lost] == ["n2"]
    assert time.monotonic() - heard_at < 6  # its silence counted again from when n1 was heard
    again = [e for e in _events(log) if e["kind"] == "coordinator_hears_again"]
    assert len(again) == 1 and again[0]["excused_s"] > 0


def test_a_lone_nodes_silence_is_its_own(served: Any) -> None:
    ep, log = served
    request(ep, "join", _join_body("n1"), job="j", key=KEY, timeout_s=5, expect="welcome")
    lost = wait_for(lambda: [e for e in _events(log) if e["kind"] == "node_lost"], 15, "n1 to be lost")
    assert [e["node_id"] for e in lost] == ["n1"]
    assert not [e for e in _events(log) if e["kind"] == "coordinator_deaf"]
