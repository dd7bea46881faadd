"""A loop's own stalls (``unicron.detect.stall``): pure, and in the coordinator's real loop,
where a stall that lands while a message is handled must not make a node's silence."""

from __future__ import annotations

import threading
import time

from unicron.coord.decide import DetectDecider
from unicron.coord.server import CoordinatorServer
from unicron.detect.stall import StallWatch
from unicron.events import EventLog
from unicron.proto.client import request

KEY = b"k" * 32


def test_a_lapse_counts_only_beyond_the_sleep_the_loop_asked_for() -> None:
    watch = StallWatch(100.0, after_s=2.0)
    assert watch.lapse(100.5, allowed_s=0.5) == 0.0  # slept as asked
    assert watch.lapse(101.0) == 0.0  # a short turn
    assert watch.lapse(106.0, allowed_s=0.5) == 4.5  # 5 s out of a 0.5 s sleep: stopped 4.5 s
    assert watch.lapse(108.5) == 2.5  # a stall between two marks without any sleep
    assert watch.lapse(110.4) == 0.0  # 1.9 s: under the threshold, a slow turn
    assert watch.lapse(111.0, allowed_s=-3.0) == 0.0  # a negative allowance is none


def test_each_mark_moves_on_so_one_stall_is_counted_once() -> None:
    watch = StallWatch(0.0, after_s=1.0)
    assert watch.lapse(10.0) == 10.0
    assert watch.lapse(10.1) == 0.0
    assert watch.mark == 10.1


def _join_body(node: str, heartbeat_timeout_s: float) -> dict:
    # Two nodes wanted: the job waits, and only the coordinator's own clock judges n1's silence.
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 2,
            "max_nodes": 2, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": heartbeat_timeout_s,
            "join_timeout_s": 60, "stop_timeout_s": 5}


def test_a_coordinator_stalled_while_handling_a_message_does_not_call_the_silence_loss(tmp_path) -> None:
    """The stall falls inside the coordinator's handling of a message (here a real 3.5 s stop of
    its thread; SIGSTOP or a VM pause in life), so the poll before it was on time: only a check
    just before the verdicts sees it. Without one, the node it could not hear is declared lost."""
    events = EventLog(tmp_path / "events.jsonl", job="j")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"})
    stall_next = threading.Event()
    handle = server._on_frames

    def stalling(frames: list[bytes], peer: str | None = None) -> None:
        if stall_next.is_set():
            stall_next.clear()
            time.sleep(3.5)  # the fault itself: the coordinator's thread does not run
        handle(frames, peer)

    server._on_frames = stalling  # type: ignore[method-assign]
    server.start()
    try:
        ep = f"127.0.0.1:{server.port}"
        request(ep, "join", _join_body("n1", heartbeat_timeout_s=3), job="j", key=KEY, timeout_s=5, expect="welcome")
        stall_next.set()
        request(ep, "status_req", {}, job="j", key=KEY, timeout_s=15, expect="status")
        # The turn that stalled has ticked by the time a later request is answered.
        snap = request(ep, "status_req", {}, job="j", key=KEY, timeout_s=5, expect="status").body["snapshot"]
        assert [(n["node_id"], n["state"]) for n in snap["nodes"]] == [("n1", "healthy")]
    finally:
        server.stop()
        events.close()
    assert "node_lost" not in (tmp_path / "events.jsonl").read_text()
