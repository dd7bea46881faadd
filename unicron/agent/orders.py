"""What the agent does when its coordinator speaks, and its ways of acting on the workers.

``Agent`` (``unicron.agent.agent``) runs the loop; this half carries out what the loop hears: a
welcome, an ``assign`` (start an attempt's workers, or defer it to the zygote), a ``stop``
(answer with the attempt's faults, stacks and snapshots), a fence, a shutdown, a refusal. It
also reads the workers' channel and stops the group, which both halves need.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import zmq

from unicron.agent import failing
from unicron.agent.attempt import (
    EarlierAttempts,
    attempt_line,
    group_spec,
    hang_detector,
    inject_warnings,
    stop_answer,
    unfired_injects,
    worker_env_factory,
)
from unicron.agent.fdlimit import check_room
from unicron.agent.inbox import WorkerInbox
from unicron.agent.joining import JoinState, Refusal
from unicron.agent.link import CoordinatorLink
from unicron.agent.logs import RunLogDir
from unicron.agent.orphans import Helpers
from unicron.agent.pace import LoopPace
from unicron.agent.rejoin import Rejoiner
from unicron.agent.reporting import Reporter
from unicron.agent.settings import AgentSettings
from unicron.agent.shm import scan_snapshots
from unicron.agent.tee import ConsoleTee
from unicron.agent.terminate import LINGER_NOTICE_S
from unicron.agent.warm import READY_WAIT_S, WarmPool
from unicron.agent.warmspec import BOOT_MODULE
from unicron.agent.workers import WorkerGroup
from unicron.detect.activity import Activity
from unicron.errors import FatalUserError, ProtocolError, WorkerFailedError
from unicron.events import EventLog
from unicron.proto.messages import Codec

log = logging.getLogger(__name__)


class AgentOrders:
    """The agent's handling of coordinator messages; its state is the ``Agent``'s (set in its
    ``__init__``)."""

    s: AgentSettings
    hosts_coordinator: bool
    said_why: str
    node_id: str
    host: str
    codec: Codec
    ui: Any
    signals: Any
    events: EventLog
    run_logs: RunLogDir
    tee: ConsoleTee
    agent_addr: str
    stack_dir: str
    shm_dir: str
    group: WorkerGroup | None
    inbox: WorkerInbox | None
    epoch: int
    link: CoordinatorLink
    reporter: Reporter
    pace: LoopPace
    earlier: EarlierAttempts
    pool: WarmPool | None
    helpers: Helpers
    pending_assign: dict[str, Any] | None
    joining: JoinState
    rejoiner: Rejoiner
    last_attempt: int | None
    assignment: dict[str, Any] | None
    clock_told: bool

    # ---- coordinator messages ------------------------------------------------------
    def _drain_coordinator(self, dealer: zmq.Socket) -> int | None:
        while True:
            try:
                raw = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                msg = self.codec.decode(raw)
            except ProtocolError as err:
                log.debug("dropped coordinator message: %s", err)
                continue
            heard_at = time.monotonic()
            silence = self.link.heard(heard_at)
            self.joining.heard(heard_at)
            if silence > 0 and self.group is not None:
                self.group.hang.paused(silence, heard_at)  # see CoordinatorLink.unheard
            body = msg.body
            if msg.kind == "welcome":
                self.epoch = body["epoch"]
                if body.get("note") and not self.hosts_coordinator:  # the host's console had it as an event
                    self.ui.warn(body["note"])
                self.rejoiner.welcomed(self.epoch, self.last_attempt)
            elif msg.kind == "ack":
                self.epoch = body["epoch"]
                self.link.heard(heard_at, Activity.parse(body.get("activity")))
                deaf_s = self.link.told_deaf(heard_at, bool(body.get("deaf")))
                if deaf_s > 0 and self.group is not None:
                    self.group.hang.paused(deaf_s, heard_at)  # see CoordinatorLink.told_deaf
                if self.group is not None:
                    told = body.get("done") == self.group.spec.attempt
                    if told and not self.group.peers_done:  # a hang this node reported was a tail: not for a resume
                        self.reporter.attempt_faults = [f for f in self.reporter.attempt_faults
                                                        if f.get("kind") != "hang"]
                    self.group.peers_done = told
                    self.group.stop_coming = body.get("stopping") == self.group.spec.attempt
                if body.get("decided") and body["decided"] != self.said_why:
                    self.said_why = body["decided"]
                    if not self.hosts_coordinator:  # the host's console showed it as it was decided
                        self.ui.warn(body["decided"])
            elif msg.kind == "assign" and not self.joining.welcomed:
                # While this node joins again, an assign is an old one the link carried late (an
                # attempt stopped long ago: 28B F4); the job's next one comes after the welcome.
                self.events.emit("assign_ignored", attempt=body["attempt"], why="not a member")
            elif msg.kind == "assign":
                self.reporter.ended_workers = []  # another attempt: its ranks come with its workers
                self._start_attempt(body)
            elif msg.kind == "stop":
                self._on_stop(body)
            elif msg.kind == "shutdown":
                self._stop_group(reason=body["reason"])
                self.events.emit("shutdown", exit_code=body["exit_code"], reason=body["reason"])
                # Signalled itself meanwhile (scancel signals every node at once; the stop waits
                # the grace for ranks that checkpoint on SIGTERM): its own 128 + n, not the
                # coordinator's node's interruption (acceptance 23B F2).
                self.signals.raise_if_received()
                if body["exit_code"] != 0:
                    raise WorkerFailedError(body["reason"], int(body["exit_code"]))
                self.ui.info("job finished: all workers exited 0")
                return 0
            elif msg.kind == "reject" and "clock" in body:  # the codec took the coordinator's time
                if not self.clock_told:
                    self.clock_told = True
                    self.ui.warn(body["reason"])
                    self.events.emit("clock_offset", offset_s=round(self.codec.offset_s, 3))
            elif msg.kind == "reject":
                refusal = self.joining.on_reject(body)
                finished = self.group is not None and self.group.finished_reported
                if refusal is Refusal.FENCED and finished and body.get("lost") is not True:
                    # Its part is done: joining again would run the whole job once more, from its
                    # first step (a coordinator's node replaced as the job ended: acceptance 21B F3).
                    # Not when this coordinator declared it lost: its job restarts and waits for it
                    # (acceptance 23A F3: it exited 0, and the job waited the join timeout).
                    return self.rejoiner.end_unconfirmed(f"fenced by the coordinator: {body['reason']}")
                if refusal is Refusal.FENCED:
                    self._fenced(body["reason"])
                elif refusal is Refusal.UNKNOWN:
                    self.rejoiner.resume(body["reason"], self.last_attempt, self._resume_fields, finished=finished)
                elif refusal is Refusal.WAIT and (notice := self.joining.waiting_notice(body["reason"])):
                    self.ui.warn(notice)

    def _fenced(self, reason: str, *, cut_off: bool = False) -> None:
        """The coordinator no longer counts this node (see ``unicron.agent.joining``), or is cut
        off from it (``cut_off``: ``Rejoiner.unreachable``). Its workers' peers are gone: stop
        them, keep their snapshots, and join again. A job that is over, or full, refuses the
        join, and the agent ends as before."""
        attempt = self.group.spec.attempt if self.group is not None else self.last_attempt
        if self.pending_assign is not None:  # assigned, its workers not started yet: lost from that one
            attempt = self.pending_assign["attempt"]
        working = self.group is not None or self.pending_assign
        if cut_off:
            workers = "stopping this node's workers, keeping their snapshots, and " if working else ""
            self.ui.warn(f"{reason}; {workers}joining again for up to {self.joining.full_timeout_s:g} s")
        else:
            workers = "stopping this node's workers and " if working else ""
            self.ui.warn(f"fenced by the coordinator ({reason}); {workers}joining again")
        self._stop_group(reason=("cut off: " if cut_off else "fenced: ") + reason)
        self.rejoiner.fenced(reason, attempt, cut_off=cut_off)

    def _resume_fields(self) -> dict[str, Any]:
        return self.rejoiner.resume_fields(self.group, self.assignment, pending=self.pending_assign is not None,
                                           epoch=self.epoch, faults=self.reporter.attempt_faults)

    def _start_attempt(self, body: dict[str, Any]) -> None:
        self._stop_group(reason="new attempt")
        self.epoch = body["epoch"]
        self.assignment, self.reporter.attempt_faults = body, []
        pool = self.pool
        if pool is not None and not pool.settled():
            self.pending_assign = body  # the zygote is importing: its workers come sooner than cold ones
            return
        self._launch(body)

    def _start_pending(self) -> None:
        """Start a deferred attempt once the zygote is ready, died, or took too long."""
        body, pool = self.pending_assign, self.pool
        if body is None or pool is None:
            return
        waited = time.monotonic() - (pool.started_at or 0.0)
        if pool.settled() or waited > READY_WAIT_S:
            self.pending_assign = None
            self._launch(body)

    def _launch(self, body: dict[str, Any]) -> None:
        # A signal that came while this turn read the assign (a Ctrl-C as a backoff ended) stops
        # the agent before any worker starts, not after (27B F5: they started, then were stopped).
        self.signals.raise_if_received(workers=self.last_attempt is not None)
        spec = group_spec(body, self.s)
        check_room(spec.local_world_sizes[spec.node_rank])  # one clear line, not ZeroMQ's abort with ranks half started
        hang = hang_detector(self.s, self.earlier.startup_hint(spec))
        env_for = worker_env_factory(self.s, spec, agent_addr=self.agent_addr, stack_dir=self.stack_dir,
                                     shm_dir=self.shm_dir, watch_start_s=hang.startup_sampling_s())
        group = WorkerGroup(spec, cmd=list(self.s.cmd), env_for=env_for, run_logs=self.run_logs,
                            tee=self.tee, host=self.host, hang=hang,
                            role=self.s.role, stack_dir=self.stack_dir, pool=self.pool,
                            expect_steps=self.earlier.steps_seen, shm_dir=self.shm_dir)
        self.group = group
        newcomer = self.last_attempt is None  # the decision was made before this node came
        self.last_attempt = spec.attempt
        self.link.new_attempt()
        self.pace.watch_now()
        # Said before the workers start: what they print (an ImportError's traceback) comes after.
        if body.get("why") and not self.hosts_coordinator and body["why"] != self.said_why:
            # The host's console showed it as it was decided, and members were told then (ack)
            self.ui.warn(f"joining attempt {spec.attempt}, decided before this node came: {body['why']}"
                         if newcomer else body["why"])
        self.said_why = ""
        nproc = spec.local_world_sizes[spec.node_rank]
        self.ui.info(attempt_line(spec, [spec.rank_offset + lr for lr in range(nproc)]))
        try:
            group.start(time.time(), tick=lambda: self._heartbeat(starting=True))
        except FatalUserError as err:  # no such program, not executable: this node is not lost
            self._report({"kind": "startup", "rank": spec.rank_offset + len(group.ranks), "host": self.host,
                          "ts": time.time(), "attempt": spec.attempt, "message": str(err),
                          "steps_completed": 0})
            self._stop_group("a worker could not be started")
            return
        self.events.emit("workers_started", attempt=spec.attempt, node_rank=spec.node_rank,
                         ranks=sorted(group.ranks), world_size=spec.world_size,
                         restore_step=spec.restore_step, master_port=spec.master_port, warm=group.warm_starts,
                         first_step_allowance_s=round(group.hang.first_step_allowance_s(), 3))
        for warning in inject_warnings(spec, hooked=BOOT_MODULE in self.s.cmd):
            self.ui.warn(warning)

    def _on_stop(self, body: dict[str, Any]) -> None:
        # Answer at once: the coordinator then knows this node is alive and busy stopping (it
        # may be silent for the grace period), not frozen.
        self._heartbeat(at_once=True)
        if self.pending_assign is not None and self.pending_assign["attempt"] == body["attempt"]:
            self.pending_assign = None
        group = self.group
        stacks: dict[str, str] = {}
        finished: list[dict[str, Any]] = []
        if group is not None and group.spec.attempt == body["attempt"]:
            # What the workers said before the stop came (an `exiting` may be queued behind it),
            # and what ranks caught failing say within a second (unicron.agent.failing).
            self._drain_workers()
            if body.get("victim"):  # the first report is a lost peer's: its cause may still be on its way
                failing.wait_for_failing(group.ranks.values(), self._drain_workers)
            faults, finished, stacks = stop_answer(group, body["want_stacks"])
            for fault in faults:
                self._report(fault)
        # The first report, not the verdict: the decision that follows names the root cause.
        # Said as the stop starts: ranks that handle SIGTERM themselves (Lightning) take the
        # whole grace period, and their own lines about it come after this one.
        self.tee.sync()
        self.ui.warn(f"stopping attempt {body['attempt']} (first report: {body['reason']})")
        if group is not None and group.spec.attempt == body["attempt"]:
            self._stop_group(reason=body["reason"])
            for fault in group.confirmed_pending(time.time()):
                self.reporter.report(fault, group)  # of its attempt: self.group is gone
            self._heartbeat(at_once=True)  # the ranks as they ended, before the job may end with the stop
        snapshots, sizes = scan_snapshots(self.shm_dir)
        self._send("stopped", {"node_id": self.node_id, "attempt": body["attempt"],
                               "snapshots": snapshots, "stacks": stacks, "snapshot_bytes": sizes,
                               "finished": finished})

    # ---- workers -------------------------------------------------------------------
    def _drain_workers(self) -> int:
        """Apply the messages waiting on the workers' channel; returns how many were read."""
        if self.inbox is None:
            return 0
        group = self.group
        read, faults = self.inbox.read(group)
        # After the whole batch: another rank's step read after this exception (the socket
        # takes connections in turn) still counts in the progress the fault reports.
        for fault in faults:
            if group is not None:
                fault.update(group.how_far(time.time()))
            self._report(fault)
        return read

    def _stop_group(self, reason: str, sig: int = signal.SIGTERM) -> None:
        self.pending_assign = None
        group = self.group
        if group is None:
            return
        self.group = None
        self.earlier.ended(group)
        # A second signal to the launcher (Ctrl-C twice) kills what is left now, in any stop: the
        # first one interrupts (after a restart's stop, if one is under way).
        killed = group.stop(self.s.grace_s, sig, adopted=self.helpers.adopted,
                            abort=lambda: self.signals.escalated, exiting_first=self.signals.signum is None,
                            lingering=self._exit_lingers)
        if self.signals.signum is None:  # not worth a word when the user stopped the job
            if killed and sig != signal.SIGKILL:
                self.ui.warn(f"rank(s) {', '.join(map(str, sorted(killed)))} did not exit within the "
                             f"{self.s.grace_s:g} s grace period after {signal.Signals(sig).name}: killed")
            # Ranks whose hooks never ran (a start failure) say nothing of their faults.
            steps = {r.rank: r.step for r in group.ranks.values() if r.hooked}
            faulted = {f.get("rank") for f in self.reporter.attempt_faults}
            for notice in unfired_injects(group.spec, steps, faulted):
                self.ui.warn(notice)
        self.reporter.ended_workers = group.summary()
        self.events.emit("workers_stopped", attempt=group.spec.attempt, reason=reason, killed_ranks=killed)

    def _exit_lingers(self, ranks: list[int]) -> None:
        self.ui.warn(f"rank(s) {', '.join(map(str, ranks))} raised and did not exit within {LINGER_NOTICE_S:g} s "
                     f"(atexit hooks at work, or a non-daemon thread that keeps the interpreter? py-spy dump --pid "
                     f"shows where): the other ranks are stopped after it exits, or after the {self.s.grace_s:g} s "
                     f"grace period")

    def _report(self, fault: dict[str, Any]) -> None:
        # What the ranks wrote before it (a rank's notice of the fault it injects, its last
        # words) comes first on the console; the tee echoes it only every 0.1 s (33B F5).
        self.tee.sync()
        self.reporter.report(fault, self.group)

    def _heartbeat(self, *, at_once: bool = False, starting: bool = False) -> None:
        """``starting``: this node's workers are being started (its peers' ranks wait for them)."""
        if self.joining.welcomed:  # not a member (yet, or again): the coordinator would refuse it
            self.reporter.heartbeat(self.group, epoch=self.epoch, at_once=at_once,
                                    starting=starting or self.pending_assign is not None)

    def _send(self, kind: str, body: dict[str, Any]) -> None:
        self.reporter.send(kind, body)
