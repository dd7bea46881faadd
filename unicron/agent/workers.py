"""One attempt's local workers: spawn, follow, judge, stop.

The agent owns one ``WorkerGroup`` per attempt. It turns what the workers say on the local
channel (steps, exceptions, snapshots) and how they end (exit codes, error files, stderr)
into per-rank state for heartbeats and into fault values for the coordinator (what a fault
says of a rank: ``unicron.agent.groupfaults``; how far the attempt got: ``unicron.agent.progress``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from unicron.agent.frozen import frozen_limit_s, next_frozen_check_s, process_cpu_s
from unicron.agent.groupfaults import GroupFaults
from unicron.agent.logs import RunLogDir, capture_stderr
from unicron.agent.outside import OutsideCollectives
from unicron.agent.procs import start_worker
from unicron.agent.proctree import is_exiting, process_state
from unicron.agent.ranks import GroupSpec, RankState, status_rows
from unicron.agent.sendqueues import SendQueueWatch
from unicron.agent.stackdump import dump_stacks, keep_dumps
from unicron.agent.tee import ConsoleTee
from unicron.agent.terminate import terminate_all
from unicron.agent.usage import tree_usage
from unicron.agent.warm import WarmPool
from unicron.detect.activity import Activity, ActivityTracker
from unicron.detect.hang import HangDetector, uneven_progress

LINGER_S = 30.0  # a process this long past its script's clean end is named once (lingering_notices)


class WorkerGroup(GroupFaults):
    def __init__(self, spec: GroupSpec, *, cmd: list[str], env_for: Any, run_logs: RunLogDir, tee: ConsoleTee,
                 host: str, hang: HangDetector, role: str, stack_dir: str, pool: WarmPool | None = None,
                 expect_steps: bool = False, shm_dir: str = "") -> None:
        self.spec = spec
        self.cmd = cmd
        self.env_for = env_for
        self.run_logs = run_logs
        self.tee = tee
        self.host = host
        self.hang = hang
        self.role = role
        self.stack_dir = stack_dir
        self.shm_dir = shm_dir  # the ranks' snapshots (steps_completed)
        self.pool = pool
        self.warm_starts = 0
        # Hang detection needs step reports. A script that never steps (no torch.optim, no
        # unicron.step(), or --no-inject) must never be called hung; one that stepped in an
        # earlier attempt is held to the first-step allowance from the start.
        self.expect_steps = expect_steps
        self.ranks: dict[int, RankState] = {}
        self.started_at = 0.0
        # Monotonic time of the latest step of any rank, kept when a finished rank leaves the
        # hang detector: a script that said bye is past its last step, not without one.
        self.stepped_at: float | None = None
        self.reported_exc: set[int] = set()
        self.finished_reported = False
        self.hang_reported = False
        self.peers_done = False  # the coordinator says a rank of another node is past its last step
        self.stop_coming = False  # the coordinator stops this attempt, another node's ranks first
        self.saw_hello = False
        self.activity = ActivityTracker()
        self.sendq = SendQueueWatch()  # each rank's TCP send queues, drained (a slow collective)
        self.level = Activity.IDLE  # what the local ranks overdue for a step are doing
        self.working_at: float | None = None  # when a rank of the job was last seen working (monotonic)
        self.busy_at: float | None = None  # ... and busy
        self.linger_s = LINGER_S  # see lingering_notices
        self.outside = OutsideCollectives(hang.busy_floor_s)

    # ---- lifecycle -----------------------------------------------------------------
    def start(self, now: float, tick: Callable[[], None] = lambda: None) -> None:
        """Start every local rank; ``tick`` runs between two (the agent's heartbeat: forking
        two dozen ranks on a busy host takes seconds, longer than the heartbeat timeout)."""
        nproc = self.spec.local_world_sizes[self.spec.node_rank]
        pairs = [(lr, self.spec.rank_offset + lr) for lr in range(nproc)]
        plans = self.run_logs.prepare_attempt(self.spec.attempt, pairs, role=self.role)
        self.started_at = now
        for n, plan in enumerate(plans):
            if n:
                tick()
            plan = capture_stderr(plan)
            env = self.env_for(plan.local_rank, plan.rank, plan.error_file or "")
            # A warm interpreter (torch already imported) if one is ready, else a cold start.
            proc = self.pool.take(self.cmd, env, plan, tee=self.tee) if self.pool is not None else None
            if proc is None:
                proc = start_worker(self.cmd, env, plan, tee=self.tee)
            else:
                self.warm_starts += 1
            # A restored rank starts at the step it restores: its faults and status count from there.
            self.ranks[plan.rank] = RankState(plan.rank, plan.local_rank, proc, plan, now,
                                              step=self.spec.restore_step or 0)
        # Hang detection runs on the monotonic clock: a wall-clock step (NTP, a VM pause) must
        # not look like a stall.
        self.hang.start(time.monotonic(), list(self.ranks))

    def stop(self, grace_s: float, sig: int = signal.SIGTERM, *,
             adopted: Callable[[], Iterable[int]] | None = None, abort: Callable[[], bool] | None = None,
             exiting_first: bool = False, lingering: Callable[[list[int]], None] | None = None) -> list[int]:
        """Stop every rank's process tree, and the trees of the ``adopted`` orphans; returns the
        ranks that had to be SIGKILLed (still running at the end of the grace period, or when
        ``abort()`` said so first)."""
        # Every worker, dead ones too: a dead worker's children (data loaders) may still run.
        # Ranks whose script raised or called sys.exit are exiting already: left to finish, the
        # others stopped after them (``exiting_first``: a fault's stop) or at once (an interrupt).
        exiting = [r.proc.pid for r in self.ranks.values()
                   if (r.exception is not None and r.exception_fatal) or r.exiting_code is not None or r.closed_raising]
        report = terminate_all([r.proc for r in self.ranks.values()], grace_s, sig=sig, adopted=adopted, abort=abort,
                               exiting=exiting, exiting_s=grace_s, exiting_first=exiting_first,
                               lingering=lingering and (lambda pids: lingering(sorted(
                                   r.rank for r in self.ranks.values() if r.proc.pid in pids))))
        killed = sorted(r.rank for r in self.ranks.values() if r.proc.pid in report.killed)
        now = time.time()
        for r in self.ranks.values():
            if r.exitcode is None:
                r.exitcode = r.proc.poll()
                r.exited_at = now
                # The rank that raised (or exited non-zero by itself) failed; the others were stopped.
                r.state = "failed" if r.proc.pid in exiting and r.exitcode != 0 else "stopped"
        return killed

    # ---- inputs --------------------------------------------------------------------
    def on_message(self, msg: dict[str, Any], now: float) -> dict[str, Any] | None:
        """Apply one channel message; return a fault dict when it must be reported at once."""
        rank = msg.get("rank")
        r = self.ranks.get(rank) if isinstance(rank, int) else None
        if r is None:
            return None
        sent = msg.get("ts")
        if isinstance(sent, (int, float)) and sent < self.started_at:
            return None  # a late word from the previous attempt's worker of the same rank
        # When it happened, by the worker's clock (same host): the agent reads messages in
        # batches (agent/pace.py), so step times come from here, not from when they were read.
        at = min(float(sent), now) if isinstance(sent, (int, float)) else now
        at_m = time.monotonic() - (now - at)  # the same moment on the monotonic clock
        t = msg.get("t")
        if t == "hello":
            self.saw_hello = True
        if r.note(t, msg, at):
            self.stepped_at = max(at_m, self.stepped_at or at_m)
            self.hang.observe(r.rank, r.step, at_m)
            self.hang.forget_stepless(r.rank, lambda q: q not in self.ranks or self.ranks[q].steps_expected)
        if t == "optim" and r.exitcode is None and r.bye_at is None:
            self.hang.expect(r.rank, at_m)  # let go as stepless, it will step after all
        if t == "bye":
            self.hang.remove(r.rank)  # its script is done: no more steps to wait for
        if t == "exc" and r.exception is not None:
            if msg.get("fatal") is False or r.fault_pending:
                return None  # a background thread died (kept for its exit), or see confirmed_pending
            if r.rank not in self.reported_exc:
                self.reported_exc.add(r.rank)
                latency = round(max(0.0, now - sent), 4) if isinstance(sent, (int, float)) else None
                return self._exception_fault(r, r.exception, now, at=at, latency_s=latency)
        if t == "alive" or (r.alive_at is not None and (r.bye_at is not None or r.closed_cleanly)):
            # Past its end, any word says its Python runs (unicron.agent.frozen).
            r.alive_at, r.alive_cpu_s = at_m, process_cpu_s(r.proc.pid)
        if t == "moved":
            self.activity.moved(r.rank, at_m)
        elif t == "data":
            self.activity.waits_for_data(r.rank, at_m)
        return None

    def poll(self, now: float) -> tuple[list[dict[str, Any]], bool]:
        """Reap exits. Returns (faults for ranks that just failed, every rank exited 0)."""
        faults = []
        for r in self.ranks.values():
            if r.exitcode is not None:
                continue
            code = r.proc.poll()
            if code is None:
                continue
            r.exitcode, r.exited_at = code, now
            r.state = "exited" if code == 0 else "failed"
            if code != 0:
                if r.fault_pending and code < 0:  # a signal no stop of ours sent (the OOM killer):
                    r.caught()  # it, not an exception that may have been caught, ended the rank (28A F3)
                r.fault_pending = False  # its exception (kept on the rank) explains the exit
                faults.append(self._exit_fault(r, now))
            else:
                r.caught()
                self.hang.remove(r.rank)
        done = all(r.exitcode == 0 for r in self.ranks.values())
        return faults, done

    def settle_dying(self, timeout_s: float = 1.0) -> list[dict[str, Any]]:
        """Faults of ranks that already died but are not reapable yet.

        A process that exits tears its threads down before the kernel lets the parent reap it,
        and its peers may see its sockets close (and fail) in between: it counts as dying from
        the first moment of its exit (``proctree.is_exiting``), not only once it is a zombie.
        Waiting for those few milliseconds keeps the real root cause (its exit code) from being
        lost to its victims.
        A rank that announced a non-zero ``SystemExit`` is dying too, though its interpreter
        may take a second to tear down: if it is still alive at the deadline, its fault is
        reported with the code it announced (the stop that follows kills it).
        """
        faults: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while True:
            faults += self.poll(time.time())[0]
            dying = [r for r in self.ranks.values()
                     if r.exitcode is None and ((r.exiting_code is not None and not r.fault_pending)
                                                or is_exiting(r.proc.pid))]
            if not dying:
                return faults
            if time.monotonic() > deadline:
                for r in dying:
                    if r.exiting_code is not None and not r.fault_pending:  # a pending one may be caught
                        r.exitcode, r.exited_at, r.state = r.exiting_code, time.time(), "failed"
                        faults.append(self._exit_fault(r, r.exited_at))
                return faults
            time.sleep(0.005)

    def sample_activity(self, mono: float) -> Activity:
        """Sample the local ranks' CPU and I/O while the job is overdue for a step; returns what
        they are doing (``self.level``). Nothing is read while steps flow."""
        if self.hang.overdue_s(mono) < self._sampling_starts_s():
            self.activity.reset()
            self.level = Activity.IDLE
            return self.level
        if self.activity.due(mono):
            self.activity.add(mono, {r.rank: tree_usage(r.proc.pid, self.sendq) if r.exitcode is None else None
                                     for r in self.ranks.values()})
        self.level = self.activity.level(mono) or Activity.IDLE
        stats = self.hang.stats
        steps = {r: (stats.last_step(r) or 0, stats.last_progress(r) or 0.0) for r in stats.ranks}
        if uneven_progress(steps, mono, self.activity.rule.window_s):  # one trains on alone: progress
            self.level = Activity.WORKING
        return self.level

    def _sampling_starts_s(self) -> float:
        """How overdue the job must be before its ranks' CPU and I/O are sampled (before every
        rank's first step: ``HangDetector.startup_sampling_s``)."""
        if not self.hang.stats.started_all():
            return self.hang.startup_sampling_s()
        step_s = self.hang.stats.job_median()
        idle_threshold, _ = self.hang.threshold_s(busy=False)
        # Late enough that a healthy step never pays for it, early enough that the evidence
        # (one window) reaches every agent before the idle threshold runs out.
        return min(max(0.3, 1.5 * step_s if step_s else 0.3), 0.4 * idle_threshold)

    def failure_reported(self) -> bool:
        """Some rank already failed (a non-zero exit, a fatal exception): the coordinator is
        deciding; the others waiting on it are not a hang of their own."""
        return bool(self.reported_exc) or any(r.exitcode not in (None, 0) for r in self.ranks.values())

    def _hang_possible(self) -> bool:
        """No verdict once some rank failed, nor for ranks that report no steps (none expected,
        none seen: they cannot be overdue), nor once some rank finished cleanly or destroyed its
        default process group: the job is past its last step (no collective can join every rank
        again), and what the ranks do in their tail (an upload, ``wandb.finish()``, a sleep) is
        not a hang. The same once a rank of another node is (``peers_done``), or once the
        coordinator stops the attempt (``stop_coming``: another node's rank raised, and this
        node's stop comes once that rank has exited; its peers here wait on it meanwhile). Nor
        while a rank that destroyed its group with an exception in hand has not ended: it ends
        the attempt (a failure, named by its exception) or went past its last step (caught),
        and what it does meanwhile is its cleanup (acceptance 28A F1/F2: a hang was called on it)."""
        if self.failure_reported() or self.past_last_step() or self.peers_done or self.stop_coming:
            return False
        if any(r.fault_pending and r.exitcode is None for r in self.ranks.values()):
            return False
        # A rank that built an optimizer will report steps: before its first one the
        # first-step allowance applies, in the first attempt too (a rank stuck in its start-up
        # while the others wait in a collective is a hang, found after --first-step-timeout).
        return self.expect_steps or any(r.steps_in_attempt or r.steps_expected for r in self.ranks.values())

    def past_last_step(self) -> bool:
        """Some local rank finished cleanly or destroyed its default process group. Even if the
        others step on after it (uneven data): their tail after their own last step (an upload,
        ``wandb.finish()``) cannot be told from a pause between steps, and re-arming the verdicts
        called those tails hangs (acceptance 24A F3/F6); a hang after an uneven end waits for the
        collective's timeout, as under torchrun (23C F3, a documented limit)."""
        return any(r.bye_at is not None or r.exitcode == 0 or r.closed_cleanly
                   for r in self.ranks.values())

    def next_check_s(self, mono: float) -> float:
        """How long ``check_hang`` has nothing to do unless a message comes first: until the
        activity sampling or the earliest hang verdict is due (0 while sampling: check every
        tick; inf when no hang can be called)."""
        linger = min(min((bye_at + self.linger_s - mono for _, bye_at in self._lingering()), default=float("inf")),
                     next_frozen_check_s(self.ranks.values(), mono, frozen_limit_s(self.hang.busy_floor_s)))
        if self.hang_reported or not self._hang_possible():
            return max(0.0, linger)
        wait = min(self.hang.quiet_s(mono), self._sampling_starts_s() - self.hang.overdue_s(mono))
        return max(0.0, min(wait, linger))

    def _lingering(self) -> list[tuple[RankState, float]]:
        return [(r, r.bye_at) for r in self.ranks.values()
                if r.bye_at is not None and r.exitcode is None and not r.lingering_named]

    def lingering_notices(self, mono: float) -> list[tuple[RankState, str]]:
        """Ranks whose script ended cleanly ``linger_s`` ago while their process lives on, each
        named once. No hang verdict: a non-daemon thread may be finishing an upload (torchrun
        waits for it too); only the user can tell that from a thread that never ends."""
        out = []
        for r, bye_at in self._lingering():
            if mono - bye_at < self.linger_s:
                continue
            r.lingering_named = True
            stopped = " and is stopped (SIGSTOP: send it SIGCONT)" if process_state(r.proc.pid) in "tT" else ""
            out.append((r, f"rank {r.rank}'s script ended {mono - bye_at:.0f} s ago but its process "
                           f"(pid {r.proc.pid}) has not exited{stopped}; a non-daemon thread or an atexit handler "
                           "still runs, or its interpreter hangs in teardown; waiting for it, as torchrun does"))
        return out

    def last_sign_of_life(self, mono: float, *, alone: bool) -> float | None:
        """While the coordinator is silent: monotonic time of the latest step, or of work seen
        between steps (an evaluation, a checkpoint: ``working_at``). The ranks of a job ``alone``
        on one node wait on nobody: while all run and none failed (nor was called hung), now."""
        if alone and self.ranks and not self.hang_reported and not self.failure_reported() \
                and all(r.exitcode is None for r in self.ranks.values()):
            return mono
        return max((t for t in (self.last_step_at(), self.working_at) if t is not None), default=None)

    def last_step_at(self) -> float | None:
        """Monotonic time of the latest step any rank completed in this attempt (None before one)."""
        stats = self.hang.stats
        tracked = [ts for r, ts in stats.last_progress_all().items() if stats.last_step(r) is not None]
        return max([*tracked, *([self.stepped_at] if self.stepped_at is not None else [])], default=None)

    def exit_fds(self) -> dict[int, int] | None:
        """pidfd -> rank of every live worker (readable once it exits); None if some worker
        has none (kernel before 5.3): then only polling sees its exit."""
        fds = {}
        for r in self.ranks.values():
            if r.exitcode is None:
                fd = r.proc.fileno()
                if fd is None:
                    return None
                fds[fd] = r.rank
        return fds

    def check_hang(self, now: float, elsewhere: Activity = Activity.IDLE) -> dict[str, Any] | None:
        """A hang fault once no step came for too long. ``elsewhere``: what the other nodes'
        ranks are doing (from the coordinator); the job's level is the highest."""
        if not self._hang_possible():
            return None
        mono = time.monotonic()
        level = max(self.sample_activity(mono), elsewhere)
        if level is Activity.WORKING:
            self.working_at = mono
        elif level is Activity.BUSY:
            self.busy_at = mono
        verdict = self.hang.check(mono, busy=level is Activity.BUSY, working_at=self.working_at,
                                  busy_at=self.busy_at)
        if verdict is not None and not verdict.busy and self.outside.seen(mono, verdict, self.ranks.values(),
                                                                           self.spec.nnodes, self.stack_dir):
            verdict = self.hang.check(mono, busy=True, working_at=self.working_at, outside=True)
        if verdict is None:
            return None
        verdict = replace(verdict, one_node_of_several=self.spec.nnodes > 1)
        for r in self.ranks.values():
            if r.exitcode is None:
                r.state = "hung"
        return {"kind": "hang", "rank": None, "host": self.host, "ts": now, "attempt": self.spec.attempt,
                "message": verdict.message, "latency_s": round(verdict.stalled_s, 3),
                # Of the ranks still running: one that ended cleanly early (uneven data) is not behind.
                "steps_completed": min((r.step for r in self.ranks.values() if r.exitcode is None),
                                       default=min((r.step for r in self.ranks.values()), default=0)),
                **self.how_far(now)}

    # ---- outputs -------------------------------------------------------------------
    def dump_stacks(self) -> dict[str, str]:
        """Every live rank's Python stack (see ``unicron.agent.stackdump``); the signal would kill
        a worker without the handler (``--no-inject``, or still starting), so those are skipped."""
        live = {r.rank: r.proc.pid for r in self.ranks.values()
                if r.hooked and r.exitcode is None and r.proc.poll() is None}
        stacks = dump_stacks(live, self.stack_dir)
        keep_dumps(stacks, self.run_logs.attempt_dir(self.spec.attempt))
        return stacks

    def summary(self) -> list[dict[str, Any]]:
        return status_rows(self.ranks.values())
