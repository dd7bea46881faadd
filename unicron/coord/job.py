"""The job state machine of the coordinator (pure: time and messages in, commands out).

Phases: WAITING (for nodes, or a restart's backoff) -> RUNNING(attempt) -> STOPPING
(every node stops its workers and acknowledges) -> RUNNING(attempt + 1) | DONE | FAILED.

Every fault stops the whole attempt at once (a collective cannot be trusted to return once a
peer is gone); the decision on what to do next is taken when every node has stopped, on the
root cause among all faults of the attempt, not on whichever report came first
(``unicron.coord.stopping``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from unicron.coord.assign import attempt_messages, merged_injects
from unicron.coord.decide import Decider, Decision, reports_a_victim
from unicron.coord.evidence import job_activity, join_mismatch, next_tick_s, past_last_step, silent_nodes
from unicron.coord.membership import Membership, NodeState
from unicron.coord.outbox import Emit, Finish, OpenStore, Out, Send
from unicron.coord.records import Attempt, JobSpec, Phase
from unicron.coord.restore import Holdings, choose_restore
from unicron.coord.resume import MAX_HISTORY, rejoined, store_casualties, store_casualty, take_back
from unicron.coord.stopping import after_stop, all_stopped, node_gone, stop_attempt, stop_the_rest, unacked
from unicron.coord.view import describe_fault, fault_fields, job_view
from unicron.detect.activity import Activity


class JobCore:
    def __init__(self, spec: JobSpec, decider: Decider, now: float) -> None:
        self.spec = spec
        self.decider = decider
        self.members = Membership(spec.min_nodes, spec.max_nodes, last_call_s=spec.last_call_s,
                                  heartbeat_timeout_s=spec.heartbeat_timeout_s)
        self.phase = Phase.WAITING
        self.created_at = now
        self.waiting_since = now
        self.not_before = now
        self.attempt: Attempt | None = None
        self.next_attempt = 0
        self.restarts_used = 0
        self.restore_step: int | None = None
        self.restore_note = ""  # why the attempt restores nothing though snapshots were kept
        self.why_next = ""  # the decision that the next attempt carries out, as the console says it
        self.holdings: Holdings | None = None  # the snapshots nodes hold since the last stop
        self.history: list[Decision] = []
        self.restarts: list[dict[str, Any]] = []
        self.store_pending = False
        self.exit_code: int | None = None
        self.final_reason = ""
        self.ended_at: float | None = None  # the view's "up" stops here (a standalone coordinator keeps it)
        self.recent_events: deque[dict[str, Any]] = deque(maxlen=50)
        # For metrics: detection latencies, seconds without workers, snapshot bytes restored.
        self.detections: list[float] = []
        self.downtime_s = 0.0
        self.transfer_bytes = 0
        self.down_since: float | None = None  # since when no attempt runs (set by a stop)
        self._told_silent: frozenset[str] = frozenset()  # silent nodes the others were told of
        self._refused: dict[str, str] = {}  # node -> why its last join was refused (logged once)
        self.awaiting_resume: set[str] = set()  # nodes of an attempt taken back, not heard resuming yet
        self.injects: dict[str, str] = {}  # node -> its --inject (UNICRON_INJECT form), as it joined
        self.roles: dict[str, str] = {}  # node -> its --role, as it joined
        # node -> what its resume said of the attempt's store (unicron.coord.resume.store_after_resume)
        self.store_said: dict[str, str] = {}
        # (attempt, port): an attempt taken back whose store was opened again
        self.store_reopened: tuple[int, int] | None = None
        self.taken_back: int | None = None  # the attempt a resume took back (its store died before)
        self.pinned: set[str] = set()  # nodes never left out: the one whose agent hosts this coordinator
        # node -> not declared lost before then, silent or not (unicron.coord.hearing: a link that
        # is back, whose connections retransmit); dropped when the node is heard
        self.loss_deferred: dict[str, float] = {}
        self.excluded: dict[str, str] = {}  # node -> why a reconfigure left it out (its joins are refused)

    # ---- messages from agents ------------------------------------------------------
    def on_join(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        if self.phase in (Phase.DONE, Phase.FAILED):
            return self.refuse(node_id, body["host"], f"job {self.spec.job_id} is over")
        mismatch = join_mismatch(self.spec, body) or self.excluded.get(node_id)
        if mismatch is not None:
            return self.refuse(node_id, body["host"], mismatch)
        if "resume" in body:
            return take_back(self, node_id, body, now)  # its coordinator restarted
        known = self.members.is_active(node_id)
        self.injects[node_id] = body.get("inject", "")
        self.roles[node_id] = body.get("role", "")
        result = self.members.join(node_id, body["host"], body["nproc"], body.get("node_rank"), now)
        if not result.accepted:
            return self.refuse(node_id, body["host"], result.reason, waits=result.transient)
        self._refused.pop(node_id, None)
        note = {"note": result.reason} if result.reason else {}
        out: list[Out] = [Send(node_id, "welcome", {"node_id": node_id, "epoch": self.members.epoch, **note})]
        if note:
            out.append(Emit("join_note", {"node_id": node_id, "host": body["host"], **note}))
        if known:
            return out
        out.append(Emit("join", {"node_id": node_id, "host": body["host"], "nproc": body["nproc"],
                                 "epoch": self.members.epoch,
                                 **({"rejoin_attempt": body["attempt"]} if "attempt" in body else {})}))
        out += rejoined(self, node_id, body, now)
        if self.phase is Phase.RUNNING and self.attempt is not None:
            # A late joiner below MAX: re-form the job with it (torchrun re-rendezvouses too).
            self.attempt.scale_up = True
            out += stop_attempt(self, f"node {node_id} joined: growing to {self.members.count()} nodes", now,
                                want_stacks=False)
        return out

    def refuse(self, node_id: str, host: str, reason: str, *, waits: bool = False) -> list[Out]:
        """Refuse a join; logged (and shown on the coordinator's console) once per node and reason,
        since a waiting agent asks every second."""
        out: list[Out] = [Send(node_id, "reject", {"reason": reason, **({"wait": True} if waits else {})})]
        if self._refused.get(node_id) != reason:
            self._refused[node_id] = reason
            out.append(Emit("join_refused", {"node_id": node_id, "host": host, "reason": reason, "waits": waits}))
        return out

    def awaits_resume(self, node_id: str) -> bool:
        """A node of an attempt taken back after a restart (``unicron.coord.resume``), not heard
        resuming yet: its heartbeats, faults, stops and finishes are answered ``unknown_job``,
        so that it says all it did while no coordinator listened in one resume, before any
        decision is taken on part of it."""
        return node_id in self.awaiting_resume and self.members.is_active(node_id)

    def on_unresumed(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        self.members.heartbeat(node_id, now)  # a sign of life all the same
        return [Send(node_id, "reject", {"reason": "the coordinator restarted", "unknown_job": True})]

    def on_heartbeat(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        before = self.job_activity(now)
        if node_id in self._told_silent and self.attempt is not None and node_id in self.attempt.node_set:
            self.attempt.heard_again(now)  # held to the busy threshold a while (Attempt.recovering)
        self._told_silent -= {node_id}
        if not self.members.heartbeat(node_id, now, body["workers"], body["health"]):
            node = self.members.nodes.get(node_id)
            lost = node is not None and node.state is NodeState.LOST
            why = "declared lost: it went silent" if lost else "not a member of the job"
            # ``lost``: this coordinator counted it, and its job wants it back (unicron.agent.orders).
            return [Send(node_id, "reject", {"reason": why, "fenced": True, **({"lost": True} if lost else {})})]
        # Only a node still running the current attempt has a say: one that finished (or an
        # old attempt's word) must not hold the others to a longer threshold.
        attempt = self.attempt
        current = attempt is not None and body.get("attempt") == attempt.number and node_id not in attempt.finished
        self.members.set_activity(node_id, Activity.parse(body.get("activity")) if current else Activity.IDLE)
        was_done = self.past_last_step()
        if current and attempt is not None:  # a rank that made a new process group takes it back
            (attempt.done.add if body.get("done") is True else attempt.done.discard)(node_id)
            attempt.note_steps(body.get("workers"), now)
        level = self.job_activity(now)
        if level > before or self.past_last_step() != was_done:
            # Every agent judges a hang by the whole job's activity: a node whose ranks wait in
            # a barrier while another node's rank evaluates must hear of it before its short
            # idle threshold runs out, not at its next heartbeat; likewise that a rank finished.
            return self.ack_all(level)
        return [Send(node_id, "ack", self._ack(level))]

    def _ack(self, level: Activity) -> dict[str, Any]:
        ack = {"epoch": self.members.epoch, "state": self.phase.value, "activity": level.name.lower()}
        if self.past_last_step() and self.attempt is not None:
            ack["done"] = self.attempt.number
        if self.phase is Phase.STOPPING and self.attempt is not None:
            ack["stopping"] = self.attempt.number  # its stop may come later (stopping.stop_attempt)
        return ack


    def past_last_step(self) -> bool:
        return past_last_step(self.phase, self.attempt)  # see unicron.coord.evidence

    def ack_all(self, level: Activity, skip: str | None = None, decided: str = "") -> list[Out]:
        """An ``ack`` to every active node but ``skip``, now (what the job is doing changed;
        ``decided``: the decision to restart just taken, for their consoles)."""
        ack = {**self._ack(level), **({"decided": decided} if decided else {})}
        return [Send(n.node_id, "ack", ack) for n in self.members.active() if n.node_id != skip]

    def job_activity(self, now: float | None = None) -> Activity:
        return job_activity(self.spec, self.members, self.phase, self.attempt, now)  # see coord.evidence

    def _silent(self, now: float) -> frozenset[str]:
        return silent_nodes(self.spec, self.members, self.phase, self.attempt, now)

    def on_fault(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        attempt = self.attempt
        if attempt is None or body["attempt"] != attempt.number or not self.members.is_active(node_id):
            return [Emit("fault_stale", {"node_id": node_id, "attempt": body["attempt"]})]
        self.members.heartbeat(node_id, now)  # any message is a sign of life
        rank = body["fault"].get("rank")
        if rank is not None and rank >= attempt.world_size:  # a signed peer's, no agent's (30B F2)
            return [Emit("fault_refused", {"node_id": node_id, "attempt": attempt.number,
                                           "why": f"rank {rank} is not a rank of this attempt's {attempt.world_size}"})]
        fault = dict(body["fault"], node_id=node_id, reported_at=now)
        if store_casualty(self, fault):
            return store_casualties(self, node_id, [fault], now)
        if fault.get("kind") == "hang" and self.past_last_step():  # a tail, sent before the agent knew
            return [Emit("hang_ignored", {"node_id": node_id, "attempt": attempt.number,
                                          "why": "a rank of another node is past its last step"})]
        attempt.faults.append(fault)
        if isinstance(fault.get("latency_s"), (int, float)):
            self.detections.append(float(fault["latency_s"]))
        out: list[Out] = [Emit("fault", fault_fields(fault))]
        if self.phase is Phase.RUNNING:
            out += stop_attempt(self, describe_fault(fault), now, want_stacks=fault.get("kind") == "hang",
                                victim=reports_a_victim(fault),
                                first=node_id if fault.get("kind") == "exception" else None)
        return out

    def on_finished(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        attempt = self.attempt
        if attempt is None or body["attempt"] != attempt.number or self.phase is not Phase.RUNNING:
            return []
        was_done = self.past_last_step()
        attempt.finished.add(node_id)
        out: list[Out] = [Emit("node_finished", {"node_id": node_id, "attempt": attempt.number})]
        if len(attempt.finished) >= len(attempt.nodes) and attempt.node_set <= attempt.finished:
            out += self.finish(0, "all workers finished successfully", now)
        elif not was_done:  # the others' ranks are in their tails now: no hang to call there
            out += self.ack_all(self.job_activity(now))
        return out

    def on_stopped(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        attempt = self.attempt
        if attempt is None or body["attempt"] != attempt.number or self.phase is not Phase.STOPPING:
            return []
        attempt.stopped[node_id] = body
        self.members.heartbeat(node_id, now)  # any message is a sign of life
        out: list[Out] = [Emit("node_stopped", {"node_id": node_id, "attempt": attempt.number})]
        if attempt.stop_waits_for == node_id:
            out += stop_the_rest(self, now)
        if all_stopped(self):
            out += after_stop(self, now)
        return out

    def on_leave(self, node_id: str, body: dict[str, Any], now: float) -> list[Out]:
        done = node_id in self._done_nodes()
        node = self.members.leave(node_id)
        if node is None:
            return []
        out: list[Out] = [Emit("leave", {"node_id": node_id, "host": node.host, "reason": body["reason"]})]
        if done:  # its workers had all exited 0 (interrupted at its exit barrier): as its silence would
            self.awaiting_resume.discard(node_id)
            return out
        out += node_gone(self, node_id, node.host, "left", body["reason"], now)
        return out

    # ---- time ----------------------------------------------------------------------
    def tick(self, now: float) -> list[Out]:
        out: list[Out] = []
        if self.phase in (Phase.DONE, Phase.FAILED):
            return out
        # A node busy stopping its workers (SIGTERM, then SIGKILL after the grace period) may be
        # silent meanwhile: the stop timeout, not the heartbeat timeout, judges it. Only one heard
        # from since the stop was sent (agents answer it at once) is busy stopping; one silent
        # since before (a frozen node, whose idle peers were just called hung) is judged as lost.
        stopping: frozenset[str] = frozenset()
        if self.phase is Phase.STOPPING and self.attempt and self.attempt.stop_sent_at is not None:
            sent = self.attempt.stop_sent_at
            # Not one taken back from another node's resume and never heard itself: its "last
            # heartbeat" is the take-back, the same instant as a stop its peer's resume caused
            # (acceptance 29B F2: lost at the stop timeout, 20 s, for the peer's error).
            stopping = frozenset(n for n in unacked(self)
                                 if self.members.nodes[n].last_heartbeat >= sent and n not in self.awaiting_resume)
        silent = self._silent(now)
        if silent - self._told_silent:  # say so at once: the others' idle thresholds are short
            out += self.ack_all(self.job_activity(now))
        self._told_silent = silent
        if self.loss_deferred:
            self.loss_deferred = {n: until for n, until in self.loss_deferred.items() if until > now}
            stopping |= frozenset(self.loss_deferred)
        stopping |= self._done_nodes()
        for node in self.members.expire(now, stopping):
            out.append(Emit("node_lost", {"node_id": node.node_id, "host": node.host,
                                          "silent_s": round(now - node.last_heartbeat, 3)}))
            self.detections.append(now - node.last_heartbeat)
            out += node_gone(self, node.node_id, node.host, "lost",
                             f"no heartbeat for {now - node.last_heartbeat:.1f} s", now)
        if self.phase is Phase.STOPPING and self.attempt is not None and self.attempt.stop_sent_at is not None:
            # A staged stop whose first node is slow: the rest are told (their timeout from now).
            if self.attempt.stop_waits_for is not None and now - self.attempt.stop_sent_at > self.spec.stop_timeout_s / 2:
                out += stop_the_rest(self, now)
            if now - self.attempt.stop_sent_at > self.spec.stop_timeout_s:
                for node_id in unacked(self):
                    gone = self.members.leave(node_id, NodeState.LOST)
                    if gone is not None:
                        out.append(Emit("node_lost", {"node_id": node_id, "host": gone.host,
                                                      "reason": "did not stop its workers in time"}))
                if all_stopped(self):
                    out += after_stop(self, now)
        if self.phase is Phase.WAITING and not self.store_pending:
            have = self.members.count()
            waited_out = now - self.waiting_since > self.spec.join_timeout_s
            # With MIN nodes the join timeout ends the wait for more (a last call longer than it).
            # Re-forming after a failure waits for no last call: the survivors are known, and a
            # node that comes later joins the running job (which re-forms with it).
            reforming = self.next_attempt > 0 and have >= self.spec.min_nodes
            if now >= self.not_before and (self.members.ready(now) or reforming
                                           or (waited_out and have >= self.spec.min_nodes)):
                self.store_pending = True
                out.append(OpenStore(self.next_attempt))
            elif waited_out and have < self.spec.min_nodes:
                out += self.finish(4, f"rendezvous timed out: {have} of at least {self.spec.min_nodes} "
                                       f"node(s) joined within {self.spec.join_timeout_s:g} s", now)
        return out

    def paused(self, gap_s: float) -> None:
        """The coordinator itself was not running for ``gap_s``: nobody's silence in that time
        counts (heartbeat and stop deadlines move on by it)."""
        if gap_s <= 0:
            return
        self.members.shift(gap_s)
        if self.attempt is not None and self.attempt.stop_sent_at is not None:
            self.attempt.stop_sent_at += gap_s

    def next_tick_s(self, now: float) -> float:
        """How long ``tick`` has nothing to do unless a message comes first (coord.evidence)."""
        return next_tick_s(self.spec, self.members, self.phase, self._told_silent, now, done=self._done_nodes())

    def _done_nodes(self) -> frozenset[str]:
        """Nodes whose workers all exited 0 while the others train on: they did their part, and
        their silence (a launcher stalled, a host paused) costs nothing, as under torchrun, whose
        agent then only waits at its exit barrier. Restarting the others to replace one killed
        their training and waited the join timeout for it (acceptance 23A F3); so did one that
        left, interrupted by SIGTERM or Ctrl-C (25A F2). Once the attempt stops for another
        reason, their silence is judged again: a restart needs them."""
        attempt = self.attempt
        return frozenset(attempt.finished) if self.phase is Phase.RUNNING and attempt is not None else frozenset()

    def start_attempt(self, master_addr: str, master_port: int, now: float) -> list[Out]:
        """Called by the shell once a fresh store for ``self.next_attempt`` is listening."""
        self.store_pending = False
        if self.phase is not Phase.WAITING:
            return []
        nodes = self.members.assign_ranks(first=self.pinned)  # the store's node: rank 0 at MASTER_ADDR
        if len(nodes) < self.spec.min_nodes:  # lost a node while the store opened
            return []
        number = self.next_attempt
        self.next_attempt += 1
        self.awaiting_resume.clear()  # the new attempt's assign reaches them all the same
        for node in self.members.nodes.values():
            node.workers = []  # the previous attempt's ranks are gone; heartbeats bring the new ones
        self._choose_restore(nodes)
        self.attempt = Attempt(number, now, [n.node_id for n in nodes], sum(n.nproc for n in nodes),
                               restore_step=self.restore_step or 0)
        self.phase = Phase.RUNNING
        if self.down_since is not None:
            self.downtime_s += now - self.down_since
            self.down_since = None
        why, self.why_next = self.why_next, ""
        return attempt_messages(number, nodes, epoch=self.members.epoch, restarts_used=self.restarts_used,
                                inject=merged_injects(self.injects.get(n.node_id, "") for n in nodes),
                                roles=[self.roles.get(n.node_id, "") for n in nodes],
                                master_addr=master_addr, master_port=master_port,
                                restore_step=self.restore_step, restore_note=self.restore_note, why=why,
                                started_at=self.created_at, restarts=self.restarts[-MAX_HISTORY:])

    def fail(self, reason: str, now: float, exit_code: int = 1) -> list[Out]:
        """The shell could not do what the job needs (e.g. open a store), or the coordinator's
        own launcher was interrupted: end the job. ``exit_code``: what the log records (the
        interrupted launcher's 130 or 143); the nodes are told 1, none of them was interrupted."""
        self.store_pending = False
        return self.finish(exit_code, reason, now, node_code=1)

    # ---- internals -----------------------------------------------------------------
    def _choose_restore(self, nodes: list[Any]) -> None:
        """The step the next attempt restores from memory, for its layout (none without holdings)."""
        holdings, self.holdings = self.holdings, None
        self.restore_step, self.restore_note, nbytes = choose_restore(holdings, [(n.node_id, n.nproc) for n in nodes])
        self.transfer_bytes += nbytes

    def finish(self, exit_code: int, reason: str, now: float, node_code: int | None = None) -> list[Out]:
        self.phase = Phase.DONE if exit_code == 0 else Phase.FAILED
        self.exit_code = exit_code
        self.ended_at = now
        self.final_reason = reason
        # Nodes turned away while the job was full wait for a place that will never come.
        over = [Send(n, "reject", {"reason": f"job {self.spec.job_id!r} ended: {reason}"}) for n in self._refused
                if not self.members.is_active(n)]
        return [Emit("job_end", {"exit_code": exit_code, "reason": reason, "restarts": self.restarts_used}), *over,
                Finish(exit_code if node_code is None else node_code, reason)]

    # ---- status --------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The status view of this job (``unicron status``; docs/status.md). ``now`` is accepted
        for the shell's convenience; the view holds absolute times and needs no clock."""
        return job_view(self)
