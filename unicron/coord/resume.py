"""A restarted coordinator takes back the attempt its nodes run (pure).

A coordinator keeps its jobs in memory only. When a standalone ``unicron coordinator`` restarts
(a crash, an upgrade, a move to a new process on the same port), training goes on: collectives
do not pass through the coordinator. The next message an agent sends finds a coordinator that
does not know the job; it is told ``unknown_job`` and joins again with ``resume``: the attempt
it runs (its number, every node of it in node-rank order, the restarts spent so far), how far
its workers got (``running``, ``finished``, or ``stopped`` by a restart that the old coordinator
began), and the faults it reported during the attempt, which may have died with the old
coordinator.

The first such join rebuilds the job: the attempt as it was, every node of it a member, the
restart budget as spent. The other nodes are asked to resume the same way (their heartbeats are
answered ``unknown_job`` until they do); one that does not is lost at the heartbeat timeout, as
any silent node. Nothing restarts unless a resume says something happened: a fault (handled as
if just reported) or workers already stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unicron.coord.outbox import Emit, OpenStore, Out, Send
from unicron.coord.records import Attempt, Phase
from unicron.coord.stopping import after_stop, all_stopped, stop_attempt
from unicron.coord.view import describe_fault, fault_fields
from unicron.detect.faults import report_problem

if TYPE_CHECKING:
    from unicron.coord.job import JobCore

STATES = ("running", "finished", "stopped")
MAX_FAULTS = 16  # the newest of an attempt's faults a resume carries
MAX_HISTORY = 16  # the newest of the job's restarts an assign, and so a resume, carries
# A restart as status shows it (JobCore.restarts): field -> type
RESTART_FIELDS: dict[str, Any] = {"attempt": int, "ts": (int, float), "cause": str, "severity": str,
                                  "action": str, "rule": str}


@dataclass(frozen=True)
class ResumedAttempt:
    """What one node says of the attempt it runs, checked (see ``parse_resume``)."""

    attempt: int
    nodes: tuple[tuple[str, str, int], ...]  # (node id, host, nproc) in node-rank order
    restarts_used: int
    epoch: int
    state: str  # one of STATES
    faults: tuple[dict[str, Any], ...]
    snapshots: dict[str, Any]  # with ``stopped``: what the node holds (as in its ``stopped`` report)
    snapshot_bytes: dict[str, Any]
    started_at: float | None = None  # when the job was created (wall clock), as its assign said
    restarts: tuple[dict[str, Any], ...] = ()  # the job's restarts before this attempt, newest last
    # With ``running``: every rank of the node is past init_process_group. One that is not may
    # still need the attempt's store, which died with the coordinator that opened it.
    started: bool = True
    # No rank of the node has called init_process_group: if no node's rank has, the store may be
    # opened again, empty, where the ranks will look for it (``master_addr``:``master_port``).
    store_untouched: bool = False
    master_addr: str = ""
    master_port: int = 0

    @property
    def node_ids(self) -> list[str]:
        return [node_id for node_id, _, _ in self.nodes]

    @property
    def world_size(self) -> int:
        return sum(nproc for _, _, nproc in self.nodes)

    def stopped_body(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots, "snapshot_bytes": self.snapshot_bytes}


def parse_resume(raw: Any, node_id: str) -> ResumedAttempt | str:
    """The resume of node ``node_id``, or why it is refused (a peer's message: anything may come)."""
    if not isinstance(raw, dict):
        return "not an object"
    attempt: Any = raw.get("attempt")
    nodes, sizes = raw.get("nodes"), raw.get("local_world_sizes")
    if not _count(attempt):
        return "attempt is not a count"
    if not isinstance(nodes, list) or not nodes or not all(
            isinstance(n, list) and len(n) == 2 and all(isinstance(x, str) for x in n) for n in nodes):
        return "nodes is not a list of [node id, host]"
    if not isinstance(sizes, list) or len(sizes) != len(nodes) or not all(_count(n) and n > 0 for n in sizes):
        return "local_world_sizes does not give every node's process count"
    ids = [n[0] for n in nodes]
    if len(set(ids)) != len(ids) or node_id not in ids:
        return "nodes repeat, or leave out the node that resumes"
    restarts: Any = raw.get("restarts_used")
    epoch: Any = raw.get("epoch")
    state: Any = raw.get("state")
    if not _count(restarts) or not _count(epoch):
        return "restarts_used or epoch is not a count"
    if state not in STATES:
        return f"state is not one of {', '.join(STATES)}"
    faults = raw.get("faults", [])
    if not isinstance(faults, list) or not all(isinstance(f, dict) for f in faults):
        return "faults is not a list of objects"
    # One the classifier cannot read is left out, as a ``fault`` message of it is dropped: taken,
    # it failed the job when the attempt's stop was decided (acceptance 29B F1).
    faults = [f for f in faults if report_problem(dict(f, node_id=node_id)) is None]
    snapshots, nbytes = raw.get("snapshots", {}), raw.get("snapshot_bytes", {})
    if not isinstance(snapshots, dict) or not isinstance(nbytes, dict):
        return "snapshots is not an object"
    started_at: Any = raw.get("started_at")
    if started_at is not None and not (isinstance(started_at, (int, float)) and not isinstance(started_at, bool)
                                       and math.isfinite(started_at)):
        return "started_at is not a time"
    history = raw.get("restarts", [])
    if not isinstance(history, list) or not all(_is_restart(r) for r in history):
        return "restarts is not a list of restarts"
    started: Any = raw.get("started", True)
    untouched: Any = raw.get("store_untouched", False)
    if not isinstance(started, bool) or not isinstance(untouched, bool):
        return "started or store_untouched is not true or false"
    addr: Any = raw.get("master_addr", "")
    port: Any = raw.get("master_port", 0)
    if not isinstance(addr, str) or not _count(port) or port > 65535:
        return "master_addr or master_port is not an address"
    extra = set(raw) - {"attempt", "nodes", "local_world_sizes", "restarts_used", "epoch", "state", "faults",
                        "snapshots", "snapshot_bytes", "started_at", "restarts", "started", "store_untouched",
                        "master_addr", "master_port"}
    if extra:
        return f"unexpected field(s) {sorted(extra)}"
    return ResumedAttempt(attempt, tuple((n[0], n[1], int(s)) for n, s in zip(nodes, sizes, strict=True)), restarts, epoch,
                          state, tuple(faults[-MAX_FAULTS:]), snapshots, nbytes,
                          None if started_at is None else float(started_at),
                          tuple({k: r[k] for k in RESTART_FIELDS} for r in history[-MAX_HISTORY:]), started,
                          untouched, addr, port)


MAX_RESUME_WINDOW_S = 30.0  # the longest a join waits for a job's members to resume it
REDIAL_S = 2.0  # how often an agent that reaches no coordinator dials a fresh connection (unicron.agent.agent)


def resume_window(age_s: float, job: str, body: dict[str, Any]) -> str | None:
    """Why a ``join`` for job ``job``, unknown to a standalone coordinator started ``age_s`` ago,
    must not create it yet (None: it may). The job may live: the coordinator restarted, and its
    members resume it within a heartbeat timeout (their next heartbeat is answered
    ``unknown_job``). Created from a replacement node's plain join first, it started again from
    attempt 0 with the whole restart budget, and fenced the members (acceptance 29B F2). The
    joiner is told to ask again (``wait``); a resume is never held."""
    # The members' resume comes with their next heartbeat once they reach this coordinator (they
    # re-dial a silent host every 2 s): a few intervals, not the whole heartbeat timeout, which
    # users raise on flaky networks (30 s made every new job on a fresh coordinator wait 30 s: 30B F4).
    interval = float(body.get("heartbeat_interval_s") or 0.5)
    window = min(float(body["heartbeat_timeout_s"]), REDIAL_S + 3 * interval, MAX_RESUME_WINDOW_S)
    if "resume" in body or age_s >= window:
        return None
    # No age in the text: the agent says a refusal once per distinct reason (each second's
    # "started 1.6 s ago", "2.6 s ago" was said again at every start of a job).
    return (f"the coordinator started less than {window:g} s ago and does not know job {job!r} yet: it gives "
            f"the job's members that long to resume it before starting it anew")


def _is_restart(record: Any) -> bool:
    return isinstance(record, dict) and all(
        isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in RESTART_FIELDS.items())


def fault_key(fault: dict[str, Any]) -> tuple[str, ...]:
    """Identifies a fault sent twice: once as a ``fault`` message, again in a resume (any JSON
    may come in a peer's fault: the key is made of its text)."""
    return tuple(repr(fault.get(k))[:200] for k in ("kind", "rank", "ts", "message"))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def take_back(core: JobCore, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
    """A ``join`` with ``resume`` from ``node_id``: the job's first takes the attempt back, each
    then counts what its node did while no coordinator listened."""
    resumed = parse_resume(body["resume"], node_id)
    if isinstance(resumed, str):
        return core.refuse(node_id, body["host"], f"cannot take the job back: {resumed}")
    out: list[Out] = []
    if core.attempt is None and core.next_attempt == 0:  # no attempt started here: take theirs back
        out += _adopt(core, resumed, now)
    attempt = core.attempt
    if attempt is None or node_id not in attempt.nodes or not core.members.is_active(node_id):
        # Not a node of it, or one lost meanwhile: it joins as any other, and the job re-forms.
        return out + core.on_join(node_id, {k: v for k, v in body.items() if k != "resume"}, now)
    node = core.members.nodes[node_id]
    node.host, node.requested_rank = body["host"], body.get("node_rank")
    core.members.heartbeat(node_id, now)
    out.insert(0, Send(node_id, "welcome", {"node_id": node_id, "epoch": core.members.epoch}))
    if node_id not in core.awaiting_resume:  # a re-sent resume
        return out
    out.append(Emit("node_resumed", {"node_id": node_id, "host": node.host, "attempt": resumed.attempt,
                                     "state": resumed.state}))
    running = core.phase is Phase.RUNNING
    if resumed.attempt != attempt.number:
        return out + _disagrees(core, node_id, resumed, now)
    seen = {fault_key(f) for f in attempt.faults}
    new = [dict(f, node_id=node_id, reported_at=now) for f in resumed.faults if fault_key(f) not in seen]
    core.awaiting_resume.discard(node_id)
    casualties = [f for f in new if store_casualty(core, f, resumed=True)]
    new = [f for f in new if f not in casualties]
    attempt.faults += new
    out += [Emit("fault", fault_fields(f)) for f in new]
    if casualties:  # a real fault beside them stops the attempt below, as its own cause
        out += store_casualties(core, node_id, casualties, now, stop=not new)
    if resumed.state == "finished":
        out += core.on_finished(node_id, {"attempt": attempt.number}, now)
    elif resumed.state == "stopped" and core.phase is Phase.STOPPING:
        out += core.on_stopped(node_id, {**resumed.stopped_body(), "attempt": attempt.number}, now)
    elif resumed.state == "stopped" and running:
        attempt.stopped[node_id] = resumed.stopped_body()
    elif resumed.state == "running" and core.phase is Phase.STOPPING and node_id not in attempt.stopped:
        # The stop went out while this node had not reconnected: it may never have had it
        # (acceptance 21C F5: it was declared lost at the stop timeout, healthy).
        out.append(Send(node_id, "stop", {"attempt": attempt.number, "want_stacks": False,
                                          "reason": attempt.stop_reason or "the attempt is stopping"}))
    if core.phase is Phase.RUNNING and (new or resumed.state == "stopped"):
        out += stop_attempt(core, describe_fault(new[0]) if new else (
            f"node {node.host} had stopped its workers of attempt {attempt.number} when the coordinator restarted"),
            now, want_stacks=False)
    elif core.phase is Phase.RUNNING and resumed.state == "running":
        out += store_after_resume(core, node_id, resumed, now)
    return out


def store_after_resume(core: JobCore, node_id: str, resumed: ResumedAttempt, now: float) -> list[Out]:
    """The attempt's store died with the old coordinator. Ranks that used it and are still in
    ``init_process_group`` would wait for it until torch's store timeout (30 min), stepping
    nothing (acceptance 21C F4): the job re-forms with a fresh store, no fault, no restart of
    the budget spent. While no rank of any node has called ``init_process_group`` (a script
    that loads first, or never calls it: acceptance 23A F1), the store is opened again, empty,
    on its port instead, and they rendezvous there as if nothing happened."""
    attempt = core.attempt
    assert attempt is not None
    said = "untouched" if resumed.store_untouched else "started" if resumed.started else "touched"
    core.store_said[node_id] = said
    host = core.members.nodes[node_id].host
    if said == "touched":
        reason = (f"the coordinator restarted while ranks on node {host} were still starting (in or before "
                  f"init_process_group): the attempt's store is gone with it")
    elif {"untouched", "started"} <= set(core.store_said.values()):
        # Some ranks are past the rendezvous the others have yet to begin (NCCL's is lazy): an
        # empty store would leave the latter waiting for keys only the dead store had.
        early = sorted(core.members.nodes[n].host for n, s in core.store_said.items() if s == "untouched")
        reason = (f"the coordinator restarted while ranks on node(s) {', '.join(early)} had not called "
                  f"init_process_group and others had: the attempt's store is gone with it")
    elif said == "untouched" and core.store_reopened is None:
        if not resumed.master_port:
            attempt.planned = True
            return stop_attempt(core, "the coordinator restarted before the attempt's ranks called "
                                      "init_process_group, and no node said where their store was", now, want_stacks=False)
        core.store_reopened = (attempt.number, resumed.master_port)
        return [OpenStore(attempt.number, port=resumed.master_port, addr=resumed.master_addr),
                Emit("store_reopening", {"attempt": attempt.number, "port": resumed.master_port})]
    else:
        return []
    attempt.planned = True  # for no fault of the job's: its ranks' peers failing on the stop are its doing
    return stop_attempt(core, reason, now, want_stacks=False)


# What a rank raises when the TCPStore it talks to goes away (torch's c10d socket errors): in an
# attempt taken back, that store died with the coordinator that opened it.
STORE_ERRORS = ("DistNetworkError", "DistStoreError")


def store_casualty(core: JobCore, fault: dict[str, Any], *, resumed: bool = False) -> bool:
    """``fault`` is a rank's loss of the attempt's store, which died with the old coordinator:
    the coordinator's doing, not the job's (acceptance 26A F1: ranks in ``init_process_group``
    fail at once on it, and the restart spent the budget). One a resume carries happened while
    no coordinator listened; one reported since, only while the store was not opened again."""
    attempt = core.attempt
    if attempt is None or core.taken_back != attempt.number or (core.store_reopened is not None and not resumed):
        return False
    text = " ".join(str(fault.get(k) or "") for k in ("error_type", "message", "summary"))
    return any(name in text for name in STORE_ERRORS)


def store_casualties(core: JobCore, node_id: str, faults: list[dict[str, Any]], now: float, *,
                     stop: bool = True) -> list[Out]:
    """Ranks of ``node_id`` lost the store of an attempt taken back: logged, not counted; the
    job re-forms with a fresh store, spending no restart (as ``store_after_resume``), unless
    not to ``stop`` (a real fault came with them)."""
    out: list[Out] = [Emit("fault", dict(fault_fields(f), store_gone=True)) for f in faults]
    if stop and core.phase is Phase.RUNNING and core.attempt is not None:
        core.attempt.planned = True
        out += stop_attempt(core, f"the coordinator restarted, and ranks on node {core.members.nodes[node_id].host} "
                                  f"lost the attempt's store with it ({describe_fault(faults[0])})", now,
                            want_stacks=False)
    return out


def store_opened_again(core: JobCore, attempt: int, port: int, error: str, now: float) -> list[Out]:
    """The shell opened the store of an attempt taken back again (``store_after_resume``), or
    could not (``error``): the ranks would wait for it, so the job re-forms with a fresh one."""
    if core.attempt is None or core.attempt.number != attempt or core.phase is not Phase.RUNNING:
        return []
    if error:
        core.attempt.planned = True
        return stop_attempt(core, f"the coordinator restarted before the attempt's ranks called "
                                  f"init_process_group, and their store could not be opened again on port {port} "
                                  f"({error})", now, want_stacks=False)
    return [Emit("store_reopened", {"attempt": attempt, "port": port})]


def _disagrees(core: JobCore, node_id: str, resumed: ResumedAttempt, now: float) -> list[Out]:
    """A node runs another attempt than the one taken back: the old coordinator died between
    two nodes' assigns (or this node missed one). The job re-forms, spending no budget; numbers
    and budget go on from the newest any node knew (never reused, never refunded)."""
    attempt = core.attempt
    assert attempt is not None
    core.awaiting_resume.discard(node_id)
    core.next_attempt = max(core.next_attempt, resumed.attempt + 1)
    core.restarts_used = max(core.restarts_used, resumed.restarts_used)
    reason = (f"node {core.members.nodes[node_id].host} runs attempt {resumed.attempt}, not {attempt.number}, "
              "after the coordinator restarted")
    # Its own workers stop too (a stop names the attempt it is for); its answer to the stop of
    # the attempt taken back is what counts.
    out: list[Out] = [Send(node_id, "stop", {"attempt": resumed.attempt, "reason": reason, "want_stacks": False})]
    if core.phase is Phase.RUNNING:
        out += stop_attempt(core, reason, now, want_stacks=False)
    return out


def _adopt(core: JobCore, resumed: ResumedAttempt, now: float) -> list[Out]:
    """Rebuild the job around the attempt its nodes run: no restart, no budget spent."""
    core.members.adopt(list(resumed.nodes), resumed.epoch, now)
    attempt = core.attempt = Attempt(resumed.attempt, now, resumed.node_ids, resumed.world_size)
    core.next_attempt, core.restarts_used = resumed.attempt + 1, resumed.restarts_used
    # The job's story as status tells it: its age and why it restarted, not this coordinator's.
    if resumed.started_at is not None and resumed.started_at < core.created_at:
        core.created_at = resumed.started_at
    if not core.restarts:
        core.restarts = [dict(r) for r in resumed.restarts]
    core.phase = Phase.RUNNING
    core.taken_back = attempt.number
    core.awaiting_resume = set(resumed.node_ids)
    out: list[Out] = [Emit("job_resumed", {"attempt": attempt.number, "nnodes": len(attempt.nodes),
                                           "world_size": attempt.world_size, "restarts_used": core.restarts_used,
                                           "epoch": core.members.epoch})]
    # Nodes that joined while this coordinator knew of no attempt (spares asking for a place):
    # the job grows with them up to --nnodes MAX; the others are turned out to ask again.
    extra = [n for n in core.members.active() if n.node_id not in attempt.nodes]
    room = max(core.spec.max_nodes - len(attempt.nodes), 0)
    for spare in extra[room:]:
        core.members.leave(spare.node_id)
        out.append(Send(spare.node_id, "reject", {"reason": f"job is full: {core.spec.max_nodes} node(s) already "
                                                  "joined", "fenced": True}))
    if extra[:room]:
        attempt.scale_up = True
        out += stop_attempt(core, f"node {extra[0].node_id} joined: growing to {core.members.count()} nodes",
                            now, want_stacks=False)
    return out


def rejoined(core: JobCore, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
    """A node of the current attempt is back (fenced, its workers stopped, its snapshots
    kept): its join counts as its stop of that attempt, no ``stop`` having reached it. What
    it holds counts only if it says it was lost from this very attempt."""
    attempt = core.attempt
    if attempt is None or node_id not in attempt.nodes:
        return []
    held = body if body.get("attempt") == attempt.number else {}
    if core.phase is Phase.STOPPING and node_id not in attempt.stopped:
        attempt.stopped[node_id] = {"snapshots": held.get("snapshots", {}),
                                    "snapshot_bytes": held.get("snapshot_bytes", {})}
        return after_stop(core, now) if all_stopped(core) else []
    if held and core.phase is Phase.WAITING and core.holdings is not None \
            and core.holdings.attempt == attempt.number:
        core.holdings.add(node_id, held)
    return []
