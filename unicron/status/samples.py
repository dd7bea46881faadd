"""Realistic status snapshots, for the renderer's tests and the capture in docs/status.md.

``python -m unicron.status.samples [--width N]`` prints the view of :func:`healed_snapshot`
as plain text; docs/status.md shows its output.
"""

from __future__ import annotations

import argparse
from typing import Any

GiB = 1024**3


def _gpu(index: int, util: int, used_gib: float, temp: int, xid: list[int] | None = None) -> dict[str, Any]:
    return {"index": index, "util": util, "mem_used": int(used_gib * GiB), "mem_total": 80 * GiB,
            "temp": temp, "xid": xid or []}


def _worker(rank: int, local_rank: int, pid: int, state: str, step: int, times: list[float],
            last_step_at: float) -> dict[str, Any]:
    return {"rank": rank, "local_rank": local_rank, "pid": pid, "state": state, "step": step,
            "iter_time_s": times[-1] if times else 0.0, "iter_times": times, "last_step_at": last_step_at}


def healed_snapshot(now: float) -> dict[str, Any]:
    """A 2-node, 4-rank job that lost rank 1 to SIGKILL at step 5 and was restarted (attempt 1)."""
    steady = [0.052, 0.051, 0.053, 0.050, 0.052, 0.051, 0.054, 0.052]
    after = [0.19, 0.061, 0.053, 0.052, 0.051, 0.052]  # the first step after a restart warms up
    t_fault = now - 42.0
    return {
        "job": {"id": "gpt-demo", "state": "running", "attempt": 1, "restarts": 1, "max_restarts": 3,
                "world_size": 4, "nnodes": 2, "min_nodes": 1, "max_nodes": 2, "started_at": now - 312.0,
                "coordinator": "trn-a:29400",
                "epoch": 3, "exit_code": None, "reason": "", "restore_step": 805, "dropped_messages": 0},
        "nodes": [
            {"node_id": "trn-a-8f3c", "node_rank": 0, "host": "trn-a", "state": "healthy",
             "last_heartbeat": now - 0.4,
             "health": {"cpu_percent": 63.0, "mem_percent": 41.0,
                        "gpus": [_gpu(0, 97, 61.2, 71), _gpu(1, 96, 61.0, 70)]},
             "workers": [_worker(0, 0, 48211, "running", 812, steady + after, now - 0.03),
                         _worker(1, 1, 48377, "running", 812, after, now - 0.04)]},
            {"node_id": "trn-b-21d0", "node_rank": 1, "host": "trn-b", "state": "healthy",
             "last_heartbeat": now - 0.7,
             "health": {"cpu_percent": 58.0, "mem_percent": 39.0,
                        "gpus": [_gpu(0, 95, 60.8, 69), _gpu(1, 97, 61.1, 72)]},
             "workers": [_worker(2, 0, 30112, "running", 812, steady + after, now - 0.02),
                         _worker(3, 1, 30113, "running", 812, steady + after, now - 0.05)]},
        ],
        "restarts": [{"attempt": 1, "ts": t_fault + 0.3, "cause": "rank 1 on trn-a killed by SIGKILL (exit -9)",
                      "severity": "SEV2", "action": "restart"}],
        "plan": {"nodes": ["trn-a", "trn-b"], "transition": ""},
        "events": [
            {"ts": t_fault, "kind": "fault", "job": "gpt-demo", "fault_kind": "exit", "rank": 1, "host": "trn-a",
             "exitcode": -9, "signal": "SIGKILL", "steps_completed": 805},
            {"ts": t_fault + 0.01, "kind": "stop", "job": "gpt-demo", "attempt": 0,
             "reason": "exit on rank 1: killed by SIGKILL", "want_stacks": False},
            {"ts": t_fault + 0.21, "kind": "node_stopped", "job": "gpt-demo", "node_id": "trn-b-21d0", "attempt": 0},
            {"ts": t_fault + 0.24, "kind": "node_stopped", "job": "gpt-demo", "node_id": "trn-a-8f3c", "attempt": 0},
            {"ts": t_fault + 0.25, "kind": "decision", "job": "gpt-demo", "attempt": 0, "action": "restart",
             "severity": "SEV2", "rule": "signal-kill", "culprits": [1]},
            {"ts": t_fault + 0.31, "kind": "attempt_start", "job": "gpt-demo", "attempt": 1, "world_size": 4,
             "nnodes": 2, "restore_step": 805},
        ],
    }


def failing_snapshot(now: float) -> dict[str, Any]:
    """The same job mid-failure: node 1 lost, ranks 2 and 3 gone, the coordinator restarting."""
    snap = healed_snapshot(now)
    snap["job"].update(state="restarting", attempt=2, restarts=2, nnodes=1)
    node_b = snap["nodes"][1]
    node_b.update(state="lost", last_heartbeat=now - 4.2)
    node_b["health"]["gpus"][1]["xid"] = [79]
    for worker in node_b["workers"]:
        worker.update(state="failed", last_step_at=now - 4.4)
    snap["nodes"][0]["workers"][0]["state"] = "hung"
    snap["restarts"].append({"attempt": 2, "ts": now - 1.0, "cause": "node trn-b-21d0 lost (no heartbeat for 3.0 s)",
                             "severity": "SEV1", "action": "reconfigure"})
    snap["job"].update(restore_step=None, dropped_messages=2)
    snap["plan"] = {"nodes": ["trn-a"], "transition": "node_lost on node trn-b: no heartbeat for 3.0 s"}
    snap["events"].append({"ts": now - 1.2, "kind": "node_lost", "job": "gpt-demo", "node_id": "trn-b-21d0",
                           "host": "trn-b", "silent_s": 3.0})
    return snap


def main() -> None:
    import time

    from rich.console import Console

    from unicron.status.render import render_status

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=110)
    parser.add_argument("--failing", action="store_true", help="show the mid-failure snapshot")
    args = parser.parse_args()
    now = time.time()
    snap = failing_snapshot(now) if args.failing else healed_snapshot(now)
    console = Console(width=args.width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render_status(snap, now))
    print(console.export_text(), end="")


if __name__ == "__main__":
    main()
