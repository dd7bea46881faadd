"""The node agent: joins the job, runs each attempt's workers, reports, obeys.

One thread, one poll loop over the coordinator DEALER, the workers' PULL, each worker's pidfd
and the launcher's signal pipe: an exit, a coordinator message or a signal wakes it at once,
workers' messages at most every 0.1 s (read in batches: ``pace``). Between events
it sleeps until something falls due (a heartbeat, the hang clock), not on a fixed tick, since
every wake-up takes CPU from the ranks; without pidfds it ticks every ``monitor_interval_s``
(at most 50 ms). Decisions are the coordinator's; the agent only observes and carries out
(what it does when told: ``unicron.agent.orders``).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from unicron.agent.attempt import (
    EarlierAttempts,
)
from unicron.agent.connwatch import ConnectionWatch
from unicron.agent.frozen import excuse_pause, frozen_limit_s, frozen_notice, frozen_ranks
from unicron.agent.hostprobe import HostProbe
from unicron.agent.inbox import WorkerInbox
from unicron.agent.janitor import Janitor
from unicron.agent.joining import JoinState, join_body
from unicron.agent.link import CoordinatorLink
from unicron.agent.logs import RunLogDir
from unicron.agent.orders import AgentOrders
from unicron.agent.orphans import Helpers
from unicron.agent.pace import LoopPace
from unicron.agent.proctree import tracer_of
from unicron.agent.rejoin import Rejoiner
from unicron.agent.reporting import Reporter
from unicron.agent.settings import AgentSettings
from unicron.agent.shm import make_shm_dir, make_work_dir
from unicron.agent.signals import SCRIPT_SIGNAL_HOLD_S
from unicron.agent.tee import ConsoleTee
from unicron.agent.warm import warm_pool
from unicron.agent.workers import WorkerGroup
from unicron.coord.peers import IDENTITY_MARK
from unicron.coord.resume import REDIAL_S
from unicron.detect.activity import Activity
from unicron.detect.stall import StallWatch
from unicron.errors import (
    Interrupted,
    UnicronError,
)
from unicron.events import EventLog
from unicron.proto.messages import Codec
from unicron.worker.env import AGENT_ADDR

log = logging.getLogger(__name__)
# REDIAL_S (unicron.coord.resume): while cut off from the coordinator, a fresh connection this often (see run)


class Agent(AgentOrders):
    def __init__(self, s: AgentSettings, *, endpoint: str, run_logs: RunLogDir, events: EventLog,
                 ui: Any, signals: Any, hosts_coordinator: bool = False) -> None:
        self.s = s
        self.hosts_coordinator = hosts_coordinator  # its coordinator ends the job when this launcher stops
        self.said_why = ""  # the decision to restart this console said (an ack told it before the assign)
        # Set by run_agent when it does: ends that coordinator's job (reason, exit code).
        self.end_own_job: Callable[[str, int], None] | None = None
        self.output_left_behind = False  # the console blocked: the rest of the workers' output is only in their files
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
        self.pool = warm_pool(s, self.agent_addr, host_stores=hosts_coordinator)
        self.helpers = Helpers(self.pool, self.janitor)
        self.pending_assign: dict[str, Any] | None = None
        self.joining = JoinState(endpoint, s.join_timeout_s, time.monotonic(), gone_after_s=self.link.lost_after_s)
        self.rejoiner = Rejoiner(self.joining, self.link, endpoint=endpoint, shm_dir=self.shm_dir, ui=ui, events=events)
        self.last_attempt: int | None = None  # the attempt of the last workers, once any started
        self.assignment: dict[str, Any] | None = None  # the last ``assign``: what a resume takes back
        self.held_since: float | None = None  # hang verdicts held (a script's signal, a debugger) since
        self.traced_told: set[int] = set()  # ranks said to be under a debugger
        self.clock_told = False  # the coordinator said this machine's clock is off (once on the console)

    # ---- main loop -----------------------------------------------------------------
    def _dial(self) -> tuple[zmq.Socket, ConnectionWatch]:
        """A connection to the coordinator: a DEALER, and the watch on its sessions."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IPV6, 1)  # an IPv6 literal endpoint needs it; IPv4 ones are unaffected
        # Named after the node (the coordinator's console names peers so) with a part nobody can
        # guess: a peer without the secret that took the plain node id first, as a restarted
        # coordinator came up, shut the real node out (ZeroMQ keeps the first of two sockets of
        # one name) and got the messages meant for it (acceptance 21C F7). The coordinator
        # answers a node on the connection of its latest message: a new one (see run) is used
        # as soon as a join comes over it.
        dealer.setsockopt(zmq.IDENTITY, f"{self.node_id}{IDENTITY_MARK}{secrets.token_hex(8)}".encode())
        dealer.setsockopt(zmq.LINGER, 1000)
        conn = ConnectionWatch(dealer)
        dealer.connect(self.endpoint)
        self.reporter.dealer = dealer
        return dealer, conn

    def run(self) -> int:
        dealer, conn = self._dial()
        probe = HostProbe(self.endpoint)
        dialed_at = time.monotonic()
        inbox = self.inbox = WorkerInbox(self.ctx, self.agent_addr)
        self.stalls = StallWatch(time.monotonic())
        try:
            while True:
                now_m = time.monotonic()
                self.signals.raise_if_received(workers=self.last_attempt is not None)
                if self.joining.cut_off is not None and now_m - dialed_at >= REDIAL_S:
                    # Cut off: the old connection's TCP backs its retransmissions off, and the
                    # coordinator's answers came 7-23 s after the link was back (acceptance 28B
                    # F3). A fresh connection, dialled anew every few seconds, gets through at once
                    # (and what the old one still carried, an assign of an attempt long stopped,
                    # is dropped with it: 28B F4).
                    conn.close()
                    dealer.close(linger=0)
                    dealer, conn = self._dial()
                    dialed_at = now_m
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
                    why = self.rejoiner.unreachable(done, self.reporter.attempt_faults)
                    if why is None:
                        return self.rejoiner.lost(done, self.reporter.attempt_faults)
                    self._fenced(why, cut_off=True)
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
            self.output_left_behind = not self.tee.close()
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
            self.group.hang.paused(gap_s, time.monotonic())  # the hang clocks are monotonic
            excuse_pause(self.group.ranks.values(), gap_s)  # nor the frozen watch's
        if stalled:  # news; a long stop is not
            self.events.emit("agent_paused", gap_s=round(gap_s, 3))

    # ---- workers -------------------------------------------------------------------
    def _kill_frozen(self, group: WorkerGroup) -> None:
        """Ranks frozen past their end (``unicron.agent.frozen``): their stacks are kept (the
        dump needs no interpreter lock), then they are killed; their exit is the attempt's fault."""
        frozen = frozen_ranks(group.ranks.values(), time.monotonic(), frozen_limit_s(group.hang.busy_floor_s))
        if not frozen:
            return
        group.dump_stacks()
        for r, silent_s in frozen:
            r.frozen = frozen_notice(r, silent_s, group.hang.busy_floor_s)
            self.ui.warn(r.frozen)
            self.events.emit("worker_frozen", rank=r.rank, pid=r.proc.pid, silent_s=round(silent_s, 3),
                             message=r.frozen)
            try:
                os.kill(r.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _traced(self, group: WorkerGroup) -> bool:
        """Whether a rank of this node is traced from outside (``gdb -p``, ``strace -p``): it is
        stopped while a person looks at it, and its peers wait on it; torchrun's job waits too.
        Its own liveness thread stops with it, so only its /proc status tells (acceptance 23B F5:
        a hang was called 1.5 s after gdb attached, and the job ended under the person)."""
        traced = {r.rank: tracer for r in group.ranks.values()
                  if r.exitcode is None and (tracer := tracer_of(r.proc.pid)) is not None}
        for rank, tracer in traced.items():
            if rank not in self.traced_told:
                self.traced_told.add(rank)
                self.ui.warn(f"rank {rank} is traced by pid {tracer} (a debugger?): no hang is called on this "
                             "node's ranks while it is")
        self.traced_told &= set(traced)
        return bool(traced)

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
        self._kill_frozen(group)
        now_m = time.monotonic()
        if self.signals.script_hold(now_m):  # the ranks run a handler of theirs (SCRIPT_SIGNALS)
            if self.held_since is None:
                self.ui.info(f"{self.signals.script_signal_name} to the launcher: left to the workers (it does not "
                             f"stop the job); no hang is called for {SCRIPT_SIGNAL_HOLD_S:g} s while their handlers run")
            self.held_since = self.held_since or self.signals.script_signal_at
            return
        if self._traced(group):  # a person looks at a rank (gdb -p): no hang of its ranks meanwhile
            self.held_since = self.held_since or now_m
            group.level = Activity.WORKING  # nor of the ranks of other nodes, that wait on it (heartbeats)
            return
        if self.held_since is not None:  # the hold is not held against the ranks' hang clocks
            group.hang.paused(now_m - self.held_since, now_m)
            self.held_since = None
        if not group.hang_reported and not self.link.unheard(now_m):
            hang = group.check_hang(now, self.link.job_level(time.monotonic()))
            outside = group.outside
            if outside.notice is not None:  # said once an attempt; each is an event
                if not outside.said:
                    self.ui.info(outside.notice)
                outside.said = True
                self.events.emit("hang_deferred", message=outside.notice, attempt=group.spec.attempt,
                                 ranks=sorted(group.ranks))
                outside.notice = None
            if hang is not None:
                group.hang_reported = True
                self._report(hang)
