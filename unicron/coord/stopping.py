"""Stopping an attempt, and what follows once it stopped (pure: state and time in, commands out).

Every fault stops the whole attempt at once: a collective cannot be trusted to return once a
peer is gone. Each node stops its workers and answers ``stopped`` (or is gone: lost, left, or
silent past the stop timeout); only then is the decision taken, on the root cause among all
the attempt's faults (``unicron.coord.decide``), not on whichever report came first: end the
job, or wait (the policy's backoff, nodes coming back) and start the next attempt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unicron.coord.decide import decide_attempt, failures
from unicron.coord.exclude import leave_out
from unicron.coord.outbox import Emit, Out, Send
from unicron.coord.records import Phase
from unicron.coord.restore import Holdings
from unicron.events import decision_line

if TYPE_CHECKING:
    from unicron.coord.job import JobCore


def node_gone(core: JobCore, node_id: str, host: str, how: str, why: str, now: float) -> list[Out]:
    """A node left or was lost (``how``): a fault of the attempt it was part of, which stops it,
    or, while it stops, one node fewer to wait for."""
    core.awaiting_resume.discard(node_id)  # back later, it is a joiner like any other
    attempt = core.attempt
    if core.phase is Phase.WAITING and core.members.count() < core.spec.min_nodes:
        # The job was still forming, or a restart backs off: said, or its console waits out the
        # join timeout in silence (acceptance 28B F1: a node that left during a backoff).
        gone = f"node {host} {how}: {why}"
        return [Emit("waiting_for_nodes", {"have": core.members.count(), "need": core.spec.min_nodes,
                                           "timeout_s": core.spec.join_timeout_s,
                                           **({"gone": gone} if attempt is None else {"left": gone})})]
    if attempt is None or node_id not in attempt.node_set:
        return []
    message = why if how == "lost" else f"{how}: {why}"  # a node that said why it left, says so
    if core.phase is Phase.RUNNING:
        attempt.faults.append({"kind": "node_lost", "node_id": node_id, "host": host, "message": message,
                               "ts": now, "reported_at": now, "attempt": attempt.number})
        return stop_attempt(core, f"node {node_id} {how}: {why}", now, want_stacks=False)
    if core.phase is Phase.STOPPING:
        attempt.faults.append({"kind": "node_lost", "node_id": node_id, "host": host, "message": message,
                               "ts": now, "reported_at": now, "attempt": attempt.number})
        out = stop_the_rest(core, now) if attempt.stop_waits_for == node_id else []
        if all_stopped(core):
            out += after_stop(core, now)
        return out
    return []


def stop_attempt(core: JobCore, reason: str, now: float, *, want_stacks: bool, victim: bool = False,
                 first: str | None = None) -> list[Out]:
    """Tell every node of the attempt to stop its workers (with their stacks, for a hang).
    ``first``: the node of a rank whose exception came before its exit. It is told alone, and
    the others once it stopped (its agent waits for that rank to exit before it signals the
    rest): as under torchrun, whose other agents learn of a failure only after the failed rank
    exited, what it finishes on its way out with its peers (``dcp.async_save``) is not cut off
    on the other nodes (acceptance 24A F1)."""
    attempt = core.attempt
    assert attempt is not None
    core.phase = Phase.STOPPING
    core.down_since = now
    attempt.stop_reason = reason
    attempt.stop_sent_at = now
    out: list[Out] = [Emit("stop", {"attempt": attempt.number, "reason": reason, "want_stacks": want_stacks})]
    body = {"attempt": attempt.number, "reason": reason, "want_stacks": want_stacks, **({"victim": True} if victim else {})}
    nodes = [n for n in attempt.nodes if core.members.is_active(n)]
    if first in nodes and len(nodes) > 1:
        attempt.stop_waits_for, attempt.stop_body = first, body
        # The others are told the stop is coming: their ranks wait on the one that raised, and
        # called that a hang before their own stop came (acceptance 25A F4, 25C F4).
        out += core.ack_all(core.job_activity(now), skip=first)
        nodes = [first]
    out += [Send(node_id, "stop", body) for node_id in nodes]
    if all_stopped(core):
        out += after_stop(core, now)
    return out


def stop_the_rest(core: JobCore, now: float) -> list[Out]:
    """The other nodes of a staged stop (``stop_attempt``'s ``first``): its node stopped, is
    gone, or took longer than half the stop timeout (its grace period and a margin)."""
    attempt = core.attempt
    if attempt is None or attempt.stop_waits_for is None:
        return []
    told, attempt.stop_waits_for = attempt.stop_waits_for, None
    attempt.stop_sent_at = now  # their stop timeout counts from now
    return [Send(n, "stop", attempt.stop_body) for n in unacked(core) if n != told]


def unacked(core: JobCore) -> list[str]:
    """The attempt's nodes still there that have not said ``stopped`` yet."""
    attempt = core.attempt
    assert attempt is not None
    return [n for n in attempt.nodes if core.members.is_active(n) and n not in attempt.stopped]


def all_stopped(core: JobCore) -> bool:
    # Asked at every node's ``stopped``: stop at the first node still stopping (a full scan each
    # time would make a stop of thousands of nodes cost O(nodes^2)).
    attempt = core.attempt
    assert attempt is not None
    return not any(n not in attempt.stopped and core.members.is_active(n) for n in attempt.nodes)


def after_stop(core: JobCore, now: float) -> list[Out]:
    """Every node of the attempt stopped (or is gone): the decision on the root cause, then
    the job's end, or a wait for the next attempt (the policy's backoff, nodes to come back)."""
    attempt = core.attempt
    assert attempt is not None
    out: list[Out] = []
    stacks = attempt.stacks()
    if stacks:
        out.append(Emit("stacks", {"attempt": attempt.number, "ranks": sorted(r for r, s in stacks.items() if s)}))
    active = core.members.count()
    decision = decide_attempt(core.decider, attempt, core.spec, stacks, now, active_nodes=active,
                              spent=core.restarts_used, pinned=frozenset(core.pinned))
    failed = bool(failures(attempt))  # not a planned re-form
    if failed:
        core.history.append(decision)
    event = {"attempt": attempt.number, "action": decision.action, "severity": decision.severity,
             "rule": decision.rule, "reason": decision.reason, "backoff_s": decision.backoff_s,
             "culprits": decision.culprits}
    out.append(Emit("decision", event))
    core.why_next = decision_line(event)  # for every node's console, with the next attempt's assign
    if decision.action in ("stop", "none"):
        return out + core.finish(decision.exit_code or 1, decision.reason, now)
    if failed:
        core.restarts_used += 1
        core.restarts.append({"attempt": attempt.number + 1, "ts": now, "cause": decision.reason,
                              "severity": decision.severity, "action": decision.action,
                              "rule": decision.rule})
    if decision.exclude:
        out += leave_out(core.members, core.excluded, core.spec.job_id, decision.exclude, decision.reason)
        active = core.members.count()
    core.holdings = Holdings(attempt.number, attempt.world_size)
    for node_id, body in attempt.stopped.items():
        core.holdings.add(node_id, body)
    core.phase = Phase.WAITING
    core.waiting_since = now
    core.not_before = now + decision.backoff_s
    if active < core.spec.min_nodes:  # say what the job waits for: it may be a long while
        out.append(Emit("waiting_for_nodes", {"have": active, "need": core.spec.min_nodes,
                                              "timeout_s": core.spec.join_timeout_s}))
    # Every node's console says the decision now, not when the next attempt's assign comes after
    # the backoff (up to 30 s) with it: acceptance 27B F4 (said late, and timed then).
    out += core.ack_all(core.job_activity(now), decided=core.why_next)
    return out + core.tick(now)
