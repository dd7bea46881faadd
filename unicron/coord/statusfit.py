"""A status reply that fits in one message, whatever the job's size (pure).

Every message is capped at ``MAX_MESSAGE_BYTES`` (4 MiB): a bigger one is refused by the sender
and would be dropped by the receiver. A job's status view holds every rank's recent iteration
times (32 a rank, as heartbeats bring them): about 3.3 KB a node of 8 ranks, so a job of 1,300
nodes passed the cap, the coordinator refused to answer, and ``unicron status`` said "no answer"
as if the coordinator were down. Instead, what does not fit is left out, and the reply says so:

1. every rank's ``iter_times`` (the view's trend column; each rank's ``iter_time_s`` stays):
   ``job.iter_times_not_shown`` is true;
2. then nodes, those in trouble (not healthy, or with a rank that is not running) kept first,
   the rest in the view's order: ``job.nodes_not_shown`` counts the others;
3. should the rest of the view still not fit (a job of hundreds of thousands of nodes), the
   plan's host list, the older restarts and events are cut too.
"""

from __future__ import annotations

import json
from typing import Any

PLAN_HOSTS_KEPT = 64  # hosts named in the plan once nodes are left out (the view shows a few)
RESTARTS_KEPT = 16
EVENTS_KEPT = 16


def size(obj: Any) -> int:
    """Bytes of ``obj`` as the wire encodes it (compact JSON, ASCII; key order does not count)."""
    return len(json.dumps(obj, separators=(",", ":")))


def fit_status(snapshot: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``snapshot`` (a ``job_view``) if it encodes in ``max_bytes``, else a copy with what does
    not fit left out, as the module says. The snapshot itself is not changed."""
    nodes = [n for n in snapshot.get("nodes") or [] if isinstance(n, dict)]
    rest = dict(snapshot, nodes=[])
    sizes = [size(n) for n in nodes]
    if _total(rest, sizes) <= max_bytes:
        return snapshot
    job = dict(snapshot.get("job") or {}, iter_times_not_shown=True)
    rest["job"] = job
    nodes = [_without_iter_times(n) for n in nodes]
    sizes = [size(n) for n in nodes]
    if _total(rest, sizes) <= max_bytes:
        return dict(rest, nodes=nodes)
    job["nodes_not_shown"] = len(nodes)  # its final value has no more digits than this
    if size(rest) > max_bytes // 2:  # leave room for nodes: cut what else grows with the job
        _cut_the_rest(rest, job)
    room = max_bytes - size(rest)
    keep: set[int] = set()
    for i in sorted(range(len(nodes)), key=lambda i: (not _in_trouble(nodes[i]), i)):
        if sizes[i] + 1 > room:  # + the comma between two
            break
        keep.add(i)
        room -= sizes[i] + 1
    job["nodes_not_shown"] = len(nodes) - len(keep)
    return dict(rest, nodes=[n for i, n in enumerate(nodes) if i in keep])


def _total(rest: dict[str, Any], sizes: list[int]) -> int:
    return size(rest) + sum(sizes) + max(len(sizes) - 1, 0)


def _without_iter_times(node: dict[str, Any]) -> dict[str, Any]:
    workers = node.get("workers")
    if not isinstance(workers, list):
        return node
    return dict(node, workers=[{k: v for k, v in w.items() if k != "iter_times"} if isinstance(w, dict) else w
                               for w in workers])


def _in_trouble(node: dict[str, Any]) -> bool:
    workers = node.get("workers")
    workers = workers if isinstance(workers, list) else []
    return node.get("state") != "healthy" or any(
        isinstance(w, dict) and w.get("state") not in ("running", None) for w in workers)


def _cut_the_rest(rest: dict[str, Any], job: dict[str, Any]) -> None:
    plan = dict(rest.get("plan") or {})
    hosts = plan.get("nodes")
    if isinstance(hosts, list) and len(hosts) > PLAN_HOSTS_KEPT:
        plan["nodes"], plan["nodes_not_shown"] = hosts[:PLAN_HOSTS_KEPT], len(hosts) - PLAN_HOSTS_KEPT
    rest["plan"] = plan
    restarts = rest.get("restarts") or []
    if len(restarts) > RESTARTS_KEPT:
        rest["restarts"] = restarts[-RESTARTS_KEPT:]
        job["restarts_not_shown"] = len(restarts) - RESTARTS_KEPT
    rest["events"] = (rest.get("events") or [])[-EVENTS_KEPT:]
