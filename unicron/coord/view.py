"""How a job describes itself: the status view (``unicron status``, docs/status.md) and the
one-line text and event fields of a fault (pure)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from unicron.coord.membership import NodeRecord, NodeState
from unicron.coord.records import Phase
from unicron.textclip import clip_line, first_line, with_type

if TYPE_CHECKING:
    from unicron.coord.job import JobCore


GONE_NODES_SHOWN = 8  # the newest nodes that left or were lost, in a status reply
ENDED = ("failed", "exited", "stopped")  # a rank's states that its node's end does not change


def job_view(core: JobCore) -> dict[str, Any]:
    attempt = core.attempt
    # Once the job is over its nodes stopped what ran (a standalone coordinator keeps showing
    # the job): no rank is still running, whatever its node last said.
    over = {Phase.DONE: "exited", Phase.FAILED: "stopped"}.get(core.phase)
    nodes = []
    # Nodes that left or were lost stay members (a lost one that comes back must be told), but
    # a job whose nodes are replaced for days would list every one: the newest few are shown.
    gone = sorted((n for n in core.members.nodes.values() if n.state is not NodeState.ACTIVE),
                  key=lambda n: n.last_heartbeat or 0.0, reverse=True)
    dropped = {n.node_id for n in gone[GONE_NODES_SHOWN:]}
    placed = attempt_ranks(core)
    for node in sorted(core.members.nodes.values(), key=lambda n: (n.state != NodeState.ACTIVE, n.node_rank)):
        if node.node_id in dropped:
            continue
        workers = [dict(w, state=over) if over and isinstance(w, dict) and w.get("state") in ("running", "hung")
                   else w for w in node.workers]
        nodes.append({"node_id": node.node_id, "node_rank": node.node_rank, "host": node.host,
                      # a member of a job that is over: not "healthy" with its heartbeat ageing (27B F10)
                      "state": over if over and node.state is NodeState.ACTIVE else node.state.value,
                      "last_heartbeat": node.heard_at if node.heard_at is not None else node.last_heartbeat,
                      # a gone node's last word on its ranks is no news of them now (33B F3)
                      "activity": node.activity.name.lower() if node.state is NodeState.ACTIVE else "unknown",
                      "health": node.health,
                      # a node that is gone has no running workers, whatever it last said; one
                      # that failed or exited is shown so still (the root cause of the job's end)
                      "workers": workers if node.state is NodeState.ACTIVE else
                      [w if w.get("state") in ENDED else dict(w, state=node.state.value)
                       for w in workers if isinstance(w, dict)] + unheard_ranks(node, workers, placed)})
    return {
        "job": {"id": core.spec.job_id, "state": core.phase.value,
                **({"gone_nodes_not_shown": len(dropped)} if dropped else {}),
                "attempt": attempt.number if attempt else 0, "restarts": core.restarts_used,
                "max_restarts": core.spec.max_restarts,
                "world_size": attempt.world_size if attempt else 0,
                "nnodes": len(core.members.active()), "min_nodes": core.spec.min_nodes,
                "max_nodes": core.spec.max_nodes, "started_at": core.created_at, "ended_at": core.ended_at,
                "epoch": core.members.epoch, "exit_code": core.exit_code, "reason": core.final_reason,
                "restore_step": core.restore_step},
        "nodes": nodes,
        "restarts": list(core.restarts),
        "plan": {"nodes": [n.host for n in core.members.active()],
                 "transition": attempt.stop_reason if core.phase is Phase.STOPPING and attempt else ""},
        "events": distinct_events(core.recent_events),
    }


def attempt_ranks(core: JobCore) -> dict[str, range]:
    """Each node of the current (or last) attempt -> the global ranks it was given, laid out
    as its ``assign`` said (``unicron.coord.assign``: node-rank order, ``nproc`` each)."""
    out: dict[str, range] = {}
    if core.attempt is None:
        return out
    offset = 0
    for node_id in core.attempt.nodes:
        node = core.members.nodes.get(node_id)
        nproc = node.nproc if node is not None else 0
        out[node_id] = range(offset, offset + nproc)
        offset += nproc
    return out


def unheard_ranks(node: NodeRecord, workers: list[Any], placed: dict[str, range]) -> list[dict[str, Any]]:
    """The ranks a gone node was given that none of its heartbeats listed, shown in its state.
    A node lost while it started its workers last said only those forked by then (its agent
    heartbeats between two forks), or none: such a rank vanished from ``unicron status`` while
    the node's other ranks showed as they ended (acceptance 33B F3). An active node's next
    heartbeat lists them all."""
    if node.state is NodeState.ACTIVE or node.node_id not in placed:
        return []
    heard = {w.get("rank") for w in workers if isinstance(w, dict)}
    ranks = placed[node.node_id]
    if not heard <= set(ranks):  # an earlier attempt's ranks (a heartbeat before its assign came)
        return []
    first = ranks.start
    return [{"rank": r, "local_rank": r - first, "pid": None, "state": node.state.value, "step": None,
             "iter_time_s": None, "iter_times": [], "last_step_at": None, "snapshot_step": None}
            for r in ranks if r not in heard]


def distinct_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events, each fault once. With the coordinator in a node's launcher, both write one
    log: the node's agent records its fault as it reports it, and the coordinator as it receives
    it. The log keeps both (each says what its writer knew); a view shows one, with the fields
    of both."""
    out: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], dict[str, Any]] = {}
    for event in events:
        if event.get("kind") == "fault":
            key = (event.get("fault_kind"), event.get("rank"), event.get("occurred_at"), event.get("attempt"))
            first = seen.get(key)
            if first is not None:
                first.update({k: v for k, v in event.items() if k not in first})
                continue
            event = dict(event)
            seen[key] = event
        out.append(event)
    return out


def describe_fault(fault: dict[str, Any]) -> str:
    where = f"rank {fault['rank']}" if fault.get("rank") is not None else f"node {fault.get('node_id') or fault.get('host', '?')}"
    kind = fault.get("kind", "fault")
    detail = first_line(str(fault.get("message") or ""))
    if fault.get("error_type"):
        detail = with_type(str(fault["error_type"]), detail)
    return f"{kind} on {where}" + (f": {clip_line(detail)}" if detail else "")


def fault_fields(fault: dict[str, Any]) -> dict[str, Any]:
    keep = ("kind", "rank", "node_id", "host", "exitcode", "signal", "error_type", "message",
            "steps_completed", "attempt", "ts")
    fields = {k: fault[k] for k in keep if fault.get(k) is not None}
    fields["fault_kind"] = fields.pop("kind", "unknown")
    if "ts" in fields:
        fields["occurred_at"] = fields.pop("ts")
    return fields
