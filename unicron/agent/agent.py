"""The node agent: joins the job, runs each attempt's workers, reports, obeys.

One thread, one poll loop over the coordinator DEALER, the workers' PULL, each worker's pidfd
and the launcher's signal pipe: an exit, a coordinator message or a signal wakes it at once,
workers' messages at most every 0.1 s (read in batches: ``pace``). Between events
it sleeps until something falls due (a heartbeat, the hang clock), not on a fixed tick, since
every wake-up takes CPU from the ranks; without pidfds it ticks every ``monitor_interval_s``
(at most 50 ms). Decisions are the coordinator's; the agent only observes and carries out.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
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
from unicron.agent.connwatch import ConnectionWatch
from unicron.agent.hostprobe import HostProbe
from unicron.agent.inbox import WorkerInbox
from unicron.agent.janitor import Janitor
from unicron.agent.joining import JoinState, Refusal, join_body
from unicron.agent.link import CoordinatorLink
from unicron.agent.logs import RunLogDir
from unicron.agent.orphans import Helpers
from unicron.agent.pace import LoopPace
from unicron.agent.rejoin import Rejoiner
from unicron.agent.reporting import Reporter
from unicron.agent.settings import AgentSettings
from unicron.agent.shm import make_shm_dir, make_work_dir, scan_snapshots
from unicron.agent.tee import ConsoleTee
from unicron.agent.warm import READY_WAIT_S, warm_pool
from unicron.agent.workers import WorkerGroup
from unicron.detect.activity import Activity
from unicron.detect.stall import StallWatch
from unicron.errors import (
    FatalUserError,
    Interrupted,
    ProtocolError,
    UnicronError,
    WorkerFailedError,
)
from unicron.events import EventLog
from unicron.proto.messages import Codec
from unicron.worker.env import AGENT_ADDR

log = logging.getLogger(__name__)


class Agent:
    def __init__(self, s: AgentSettings, *, endpoint: str, run_logs: RunLogDir, events: EventLog,
                 ui: Any, signals: Any, hosts_coordinator: bool = False) -> None:
        self.s = s
        self.hosts_coordinator = hosts_coordinator  # its coordinator ends the job when this launcher stops
        # Set by run_agent when it does: ends that coordinator's job (reason, exit code).
        self.end_own_job: Callable[[str, int], None] | None = None
        self.endpoint = endpoint
        self.run_logs = run_logs
        self.events = events
        self.ui = ui
        self.signals = signals
        self.host = s.local_addr
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.codec = Codec(s.secret, self.node_id, job=s.run_id, follows_clock=True)
        self.ctx: zmq.Context = zmq.Context.instance()
        self.work_dir = make_work_dir()  # short: ipc paths are limited to ~100 bytes
        self.shm_dir = make_shm_dir(s.run_id)
        self.agent_addr = f"ipc://{self.work_dir}/agent.sock"  # the workers' channel; marks their processes
        # removes the directories, and kills what the workers started, if this process dies
        self.janitor = Janitor([self.shm_dir, self.work_dir], marker=f"{AGENT_ADDR}={self.agent_addr}")
        self.stack_dir = os.path.join(self.work_dir, "stacks")
        os.makedirs(self.stack_dir, exist_ok=True)
        self.tee = ConsoleTee()
        self.group: WorkerGroup | None = None
        self.inbox: WorkerInbox | None = None  # the workers' channel, once bound
        self.epoch = 0
        self.link = CoordinatorLink(time.monotonic(), heartbeat_interval_s=s.heartbeat_interval_s,
                                    heartbeat_timeout_s=s.heartbeat_timeout_s, hosts_ranks=not s.coordinator)
        self.stalls = StallWatch(time.monotonic())  # reset as the loop starts
        self.reporter = Reporter(self.codec, node_id=self.node_id, host=self.host,
                                 heartbeat_interval_s=s.heartbeat_interval_s, events=events, ui=ui)
        self.pace = LoopPace(monitor_interval_s=s.monitor_interval_s, heartbeat_interval_s=s.heartbeat_interval_s)
        self.earlier = EarlierAttempts()  # what the script showed so far: it steps, its start-up
        # A zygote with torch imported forks every worker: it imports while the job forms, and
        # attempts assigned meanwhile wait for it (``pending_assign``).
        self.pool = warm_pool(s, self.agent_addr)
        self.helpers = Helpers(self.pool, self.janitor)
        self.pending_assign: dict[str, Any] | None = None
        self.joining = JoinState(endpoint, s.join_timeout_s, time.monotonic(), gone_after_s=self.link.lost_after_s)
        self.rejoiner = Rejoiner(self.joining, self.link, endpoint=endpoint, shm_dir=self.shm_dir, ui=ui, events=events)
        self.last_attempt: int | None = None  # the attempt of the last workers, once any started
        self.assignment: dict[str, Any] | None = None  # the last ``assign``: what a resume takes back
        self.clock_told = False  # the coordinator said this machine's clock is off (once on the console)

    # ---- main loop -----------------------------------------------------------------
    def run(self) -> int:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IPV6, 1)  # an IPv6 literal endpoint needs it; IPv4 ones are unaffected
        dealer.setsockopt(zmq.IDENTITY, self.node_id.encode())
        dealer.setsockopt(zmq.LINGER, 1000)
        conn, probe = ConnectionWatch(dealer), HostProbe(self.endpoint)
        dealer.connect(self.endpoint)
        inbox = self.inbox = WorkerInbox(self.ctx, self.agent_addr)
        self.reporter.dealer = dealer
        self.stalls = StallWatch(time.monotonic())
        try:
            while True:
                now_m = time.monotonic()
                self.signals.raise_if_received()
                if self.joining.join_due(now_m):
                    self._send("join", join_body(self.s, self.node_id, self.host, os.getpid(),
                                                 self.joining.join_fields()))
                    notice = self.joining.quiet_notice(now_m)
                    if notice is not None:
                        self.ui.warn(notice)
                exit_fds = self.group.exit_fds() if self.group is not None else {}
                items: list[tuple[Any, int]] = [(dealer, zmq.POLLIN), (conn.sock, zmq.POLLIN), (inbox.bell, zmq.POLLIN),
                                                (self.signals.fileno(), zmq.POLLIN)]
                if self.pace.messages_wake(now_m):
                    items.append((inbox.pull, zmq.POLLIN))
                items += [(fd, zmq.POLLIN) for fd in exit_fds or ()]
                imminent = not self.joining.welcomed or self.pending_assign is not None or exit_fds is None
                wait_s = self.pace.wait_s(now_m, last_heartbeat=self.reporter.last_heartbeat, imminent=imminent)
                self._paused(self.stalls.lapse(time.monotonic()), stalled=True)
                fired = {sock for sock, _ in zmq.zmq_poll(items, math.ceil(wait_s * 1000))}
                # Late out of the poll: this process did not run (SIGSTOP, a VM pause). Nobody's
                # silence in that time counts: not the coordinator's (its answers wait in the
                # socket) nor the ranks' hang clocks (a whole node stops together).
                self._paused(self.stalls.lapse(time.monotonic(), wait_s), stalled=True)
                if conn.sock in fired and (up := conn.read()) is not None:
                    self.link.connection(up)
                if dealer in fired:
                    result = self._drain_coordinator(dealer)
                    if result is not None:
                        return result
                rang = inbox.bell in fired and inbox.drain_bell() > 0
                # Every wake-up reads the workers' messages, the channel's own (paced) or not:
                # an exit's pidfd then finds the rank's last words already read. A ring may
                # overtake its message: the channel is then polled until the message comes.
                read = self._drain_workers()
                if rang:  # its message may not be in yet: the channel stays in the poll
                    self.pace.messages_now()
                else:
                    self.pace.messages_read(time.monotonic(), read)
                self._start_pending()
                now_m = time.monotonic()
                group = self.group
                # Each wake-up takes CPU from the ranks: between events the loop sleeps until
                # something is due (agent/pace.py) and, woken, does only what is due or was signalled.
                if (fired & set(exit_fds or ()) or self.pace.watch_due(now_m)
                        or (group is not None and group.level is not Activity.IDLE)):
                    self._watch_workers()
                    group = self.group
                    next_check = group.next_check_s(now_m) if group is not None and not group.finished_reported else None
                    self.pace.watched(now_m, next_check, exits_wake=exit_fds is not None)
                if self.pace.chores_due(now_m):
                    self.helpers.chores(self.group, self.events)
                # Likewise for a long turn (stopping workers takes up to the grace period) or a
                # stall while this turn's messages were handled.
                self._paused(self.stalls.lapse(time.monotonic()), stalled=False)
                self._heartbeat()
                group = self.group
                stepped = group.last_sign_of_life(now_m, alone=self.s.max_nodes == 1) if group is not None else None
                done = group is not None and group.finished_reported
                now_m = time.monotonic()
                probe.want(self.link.probing(now_m))  # silent over an open connection: is its host up?
                self.link.host_answered(probe.answered_at)
                if self.joining.welcomed and self.link.lost(now_m, stepped, done=done):
                    return self.rejoiner.lost(done)
        except (Interrupted, UnicronError) as err:
            # Told first, since stopping the workers may take the grace period, longer than the
            # heartbeat timeout, and this node would be judged lost meanwhile: another node's
            # coordinator re-plans without it ("leave"); our own ends the job, recording why
            # (told "leave", it would decide a node loss, a restart or a budget stop, that never
            # happens).
            why = str(err).removesuffix("; all workers stopped")  # they are being stopped now
            if self.end_own_job is not None:
                self.end_own_job(why, int(getattr(err, "exit_code", 1)))
            elif not self.hosts_coordinator:
                try:
                    self._send("leave", {"node_id": self.node_id, "reason": why})
                except zmq.ZMQError:
                    pass
            # Forward the signal we got (torchrun does too); SIGTERM for any other reason.
            self._stop_group(reason=str(err), sig=self.signals.signum or signal.SIGTERM)
            self.events.emit("agent_exit", error=str(err))
            raise
        finally:
            self._stop_group(reason="agent exit")
            if self.pool is not None:
                self.pool.close()
            self.tee.close()
            conn.close()
            probe.close()
            dealer.close(linger=500)
            inbox.close()
            shutil.rmtree(self.work_dir, ignore_errors=True)
            shutil.rmtree(self.shm_dir, ignore_errors=True)
            self.janitor.close()

    def _paused(self, gap_s: float, *, stalled: bool) -> None:
        """This agent did not listen for ``gap_s``: stopped whole (``stalled``), or busy (a long
        turn: stopping workers waits up to the grace period)."""
        if gap_s <= 0:
            return
        self.link.paused(gap_s)
        if self.group is not None:
            self.group.hang.paused(gap_s, time.time())
        if stalled:  # news; a long stop is not
            self.events.emit("agent_paused", gap_s=round(gap_s, 3))

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
                self.group.hang.paused(silence, time.time())  # see CoordinatorLink.unheard
            body = msg.body
            if msg.kind == "welcome":
                self.epoch = body["epoch"]
                if body.get("note") and not self.hosts_coordinator:  # the host's console had it as an event
                    self.ui.warn(body["note"])
                self.rejoiner.welcomed(self.epoch, self.last_attempt)
            elif msg.kind == "ack":
                self.epoch = body["epoch"]
                self.link.heard(heard_at, Activity.parse(body.get("activity")))
                if self.group is not None:
                    told = body.get("done") == self.group.spec.attempt
                    if told and not self.group.peers_done:  # a hang this node reported was a tail: not for a resume
                        self.reporter.attempt_faults = [f for f in self.reporter.attempt_faults
                                                        if f.get("kind") != "hang"]
                    self.group.peers_done = told
            elif msg.kind == "assign":
                self._start_attempt(body)
            elif msg.kind == "stop":
                self._on_stop(body)
            elif msg.kind == "shutdown":
                self._stop_group(reason=body["reason"])
                self.events.emit("shutdown", exit_code=body["exit_code"], reason=body["reason"])
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
                if refusal is Refusal.FENCED:
                    self._fenced(body["reason"])
                elif refusal is Refusal.UNKNOWN:
                    self.rejoiner.resume(body["reason"], self.last_attempt, self._resume_fields)
                elif refusal is Refusal.WAIT and (notice := self.joining.waiting_notice(body["reason"])):
                    self.ui.warn(notice)

    def _fenced(self, reason: str) -> None:
        """The coordinator no longer counts this node (see ``unicron.agent.joining``). Its
        workers' peers are gone: stop them, keep their snapshots, and join again. A job that is
        over, or full, refuses the join, and the agent ends as before."""
        attempt = self.group.spec.attempt if self.group is not None else self.last_attempt
        if self.pending_assign is not None:  # assigned, its workers not started yet: lost from that one
            attempt = self.pending_assign["attempt"]
        workers = "stopping this node's workers and " if self.group is not None or self.pending_assign else ""
        self.ui.warn(f"fenced by the coordinator ({reason}); {workers}joining again")
        self._stop_group(reason="fenced: " + reason)
        self.rejoiner.fenced(reason, attempt)

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
        spec = group_spec(body, self.s)
        hang = hang_detector(self.s, self.earlier.startup_hint(spec))
        env_for = worker_env_factory(self.s, spec, agent_addr=self.agent_addr, stack_dir=self.stack_dir,
                                     shm_dir=self.shm_dir, watch_start_s=hang.startup_sampling_s())
        group = WorkerGroup(spec, cmd=list(self.s.cmd), env_for=env_for, run_logs=self.run_logs,
                            tee=self.tee, host=self.host, hang=hang,
                            role=self.s.role, stack_dir=self.stack_dir, pool=self.pool,
                            expect_steps=self.earlier.steps_seen)
        self.group = group
        self.last_attempt = spec.attempt
        self.link.new_attempt()
        self.pace.watch_now()
        # Said before the workers start: what they print (an ImportError's traceback) comes after.
        if body.get("why") and not self.hosts_coordinator:  # the host's console showed it as it was decided
            self.ui.warn(body["why"])
        nproc = spec.local_world_sizes[spec.node_rank]
        self.ui.info(attempt_line(spec, [spec.rank_offset + lr for lr in range(nproc)]))
        try:
            group.start(time.time())
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
        for warning in inject_warnings(spec):
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
            self._stop_group(reason=body["reason"])
        # The first report, not the verdict: the decision that follows names the root cause.
        self.ui.warn(f"stopping attempt {body['attempt']} (first report: {body['reason']})")
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
                fault.update(progress=group.progress(time.time()), **group.reach())
            self._report(fault)
        return read

    def _watch_workers(self) -> None:
        group = self.group
        if group is None or group.finished_reported:
            return
        now = time.time()
        faults, done = group.poll(now)
        for fault in faults:
            self._report(fault)
        if done and group.ranks:
            group.finished_reported = True
            self.events.emit("workers_finished", attempt=group.spec.attempt)
            self._send("finished", {"node_id": self.node_id, "attempt": group.spec.attempt})
            return
        for r, notice in group.lingering_notices(time.monotonic()):
            self.ui.warn(notice)
            self.events.emit("worker_lingering", rank=r.rank, pid=r.proc.pid, message=notice)
        if not group.hang_reported and not self.link.unheard(time.monotonic()):
            hang = group.check_hang(now, self.link.job_level(time.monotonic()))
            if hang is not None:
                group.hang_reported = True
                self._report(hang)

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
                            abort=lambda: self.signals.escalated)
        if self.signals.signum is None:  # not worth a word when the user stopped the job
            # Ranks whose hooks never ran (a start failure) say nothing of their faults.
            steps = {r.rank: r.step for r in group.ranks.values() if r.hooked}
            faulted = {f.get("rank") for f in self.reporter.attempt_faults}
            for notice in unfired_injects(group.spec, steps, faulted):
                self.ui.warn(notice)
        self.events.emit("workers_stopped", attempt=group.spec.attempt, reason=reason, killed_ranks=killed)

    def _report(self, fault: dict[str, Any]) -> None:
        self.reporter.report(fault, self.group)

    def _heartbeat(self, *, at_once: bool = False) -> None:
        if self.joining.welcomed:  # not a member (yet, or again): the coordinator would refuse it
            self.reporter.heartbeat(self.group, epoch=self.epoch, at_once=at_once,
                                    starting=self.pending_assign is not None)

    def _send(self, kind: str, body: dict[str, Any]) -> None:
        self.reporter.send(kind, body)

