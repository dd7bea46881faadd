"""The numbers a job's Prometheus endpoint exposes, derived from the job core (pure)."""

from __future__ import annotations

from typing import Any

from unicron.coord.job import JobCore


def job_metrics(core: JobCore, dropped: dict[str, int]) -> dict[str, Any]:
    """``unicron.status.metrics.format_metrics`` input for one job."""
    restarts: dict[str, int] = {}
    for entry in core.restarts:
        rule = str(entry.get("rule") or "unknown")
        restarts[rule] = restarts.get(rule, 0) + 1
    steps: list[int] = [w["step"] for n in core.members.active() for w in n.workers if isinstance(w.get("step"), int)]
    speeds = [1.0 / w["iter_time_s"] for n in core.members.active() for w in n.workers
              if isinstance(w.get("iter_time_s"), (int, float)) and w["iter_time_s"] > 0]
    values: dict[str, Any] = {
        "job": core.spec.job_id,
        "restarts": restarts,
        "downtime_seconds": core.downtime_s,
        "transfer_bytes": core.transfer_bytes,
        "dropped_messages": dict(dropped),
        "detection_latencies": list(core.detections),
    }
    if core.detections:
        values["detection_latency_last"] = core.detections[-1]
    if steps:
        values["step"] = min(steps)
    if speeds:
        values["steps_per_second"] = min(speeds)
    return values
