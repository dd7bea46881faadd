"""A big job's status reply stays under the 4 MiB message limit, saying what it left out.

Acceptance (F6): with the iteration times agents send (32 per rank), 1,536 nodes of 8 ranks made
a 5.1 MB reply; the coordinator refused to send it and ``unicron status`` said "no answer
within 3 s", as if the coordinator were down."""

from __future__ import annotations

import random
from typing import Any

import pytest

from unicron.coord.decide import DetectDecider
from unicron.coord.job import JobCore
from unicron.coord.membership import NodeState
from unicron.coord.records import JobSpec
from unicron.coord.server import CoordinatorServer, JobSlot
from unicron.coord.statusfit import fit_status, size
from unicron.events import EventLog
from unicron.proto.client import request
from unicron.proto.messages import MAX_MESSAGE_BYTES

KEY = b"k" * 32
NOW = 1_750_000_000.0
GPUS = [{"index": g, "util": 97, "mem_used": 71_234_000_000, "mem_total": 85_899_345_920, "temp": 61, "xid": []}
        for g in range(8)]


def big_job(n: int, *, lost: tuple[int, ...] = (), failed: tuple[int, ...] = ()) -> JobCore:
    """``n`` nodes of 8 ranks and 8 GPUs, with the heartbeats' workers as agents send them."""
    rng = random.Random(n)
    core = JobCore(JobSpec("big", n, n, max_restarts=3), DetectDecider(), NOW)
    for i in range(n):
        node = f"gpu-node-{i:05d}.cluster.local-{100000 + i}-{rng.randrange(16 ** 6):06x}"
        core.members.join(node, f"gpu-node-{i:05d}.cluster.local", 8, None, NOW)
        core.members.nodes[node].node_rank = i
        workers = [{"rank": i * 8 + r, "local_rank": r, "pid": 200000 + r,
                    "state": "failed" if i in failed and r == 3 else "running", "step": 12345,
                    "iter_time_s": 0.8123, "iter_times": [round(rng.uniform(0.79, 0.83), 4) for _ in range(32)],
                    "last_step_at": NOW - rng.random(), "snapshot_step": 12340} for r in range(8)]
        core.members.heartbeat(node, NOW, workers, {"cpu_percent": 41.5, "mem_percent": 63.0, "gpus": GPUS})
        if i in lost:
            core.members.leave(node, NodeState.LOST)
    return core


def shown(snap: dict[str, Any]) -> set[int]:
    return {n["node_rank"] for n in snap["nodes"]}


def test_a_view_that_fits_is_sent_whole() -> None:
    snap = big_job(64).snapshot(NOW)
    assert fit_status(snap, MAX_MESSAGE_BYTES) is snap
    assert "nodes_not_shown" not in snap["job"] and "iter_times_not_shown" not in snap["job"]


def test_iteration_times_go_first_and_every_node_stays_when_that_is_enough() -> None:
    snap = big_job(1536).snapshot(NOW)
    assert size(snap) > MAX_MESSAGE_BYTES  # the acceptance run's 5.1 MB
    fitted = fit_status(snap, MAX_MESSAGE_BYTES - 1024)
    assert size(fitted) <= MAX_MESSAGE_BYTES - 1024
    assert fitted["job"]["iter_times_not_shown"] is True and "nodes_not_shown" not in fitted["job"]
    assert len(fitted["nodes"]) == 1536
    worker = fitted["nodes"][0]["workers"][0]
    assert "iter_times" not in worker and worker["iter_time_s"] == 0.8123 and worker["step"] == 12345
    assert "iter_times" in snap["nodes"][0]["workers"][0]  # the job's own view is not touched


def test_a_huge_job_keeps_the_nodes_in_trouble_and_counts_those_left_out() -> None:
    core = big_job(2500, lost=(2490,), failed=(1234,))
    fitted = fit_status(core.snapshot(NOW), MAX_MESSAGE_BYTES - 1024)
    assert size(fitted) <= MAX_MESSAGE_BYTES - 1024
    job = fitted["job"]
    assert 0 < job["nodes_not_shown"] < 2500 and job["nodes_not_shown"] + len(fitted["nodes"]) == 2500
    assert {2490, 1234} <= shown(fitted)  # a lost node, a node with a failed rank: kept first
    assert 0 in shown(fitted) and 2480 not in shown(fitted)  # then the others, in node-rank order
    assert job["nnodes"] == 2499 and job["id"] == "big"  # the job's own fields are all there


def test_even_the_rest_of_the_view_is_cut_when_it_alone_would_not_fit() -> None:
    snap = big_job(8).snapshot(NOW)
    snap["plan"]["nodes"] = [f"host-{i:07d}.example" for i in range(200_000)]  # 4.4 MB of host names
    snap["restarts"] = [{"attempt": a, "cause": "x" * 100} for a in range(100)]
    fitted = fit_status(snap, MAX_MESSAGE_BYTES - 1024)
    assert size(fitted) <= MAX_MESSAGE_BYTES - 1024 and len(fitted["nodes"]) == 8
    assert len(fitted["plan"]["nodes"]) == 64 and fitted["plan"]["nodes_not_shown"] == 200_000 - 64
    assert len(fitted["restarts"]) == 16 and fitted["job"]["restarts_not_shown"] == 84


@pytest.mark.timeout(120)
def test_the_coordinator_answers_status_for_a_job_of_2500_nodes(tmp_path) -> None:
    events = EventLog(tmp_path / "events.jsonl", job="big")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"big"})
    server.slots["big"] = JobSlot(big_job(2500), events)
    server.start()
    try:
        reply = request(f"127.0.0.1:{server.port}", "status_req", {}, job="big", key=KEY, timeout_s=30,
                        expect="status")
    finally:
        server.stop()
        events.close()
    snap = reply.body["snapshot"]
    assert snap["job"]["iter_times_not_shown"] is True and snap["job"]["nodes_not_shown"] > 0
    assert len(snap["nodes"]) + snap["job"]["nodes_not_shown"] == 2500
    assert snap["job"]["coordinator"].endswith(f":{server.port}")
