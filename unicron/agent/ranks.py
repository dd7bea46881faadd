"""What the agent knows of each local rank of an attempt, and the attempt's shape."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from unicron.agent.logs import RankLogs
from unicron.agent.procs import WorkerProcess


@dataclass
class RankState:
    rank: int
    local_rank: int
    proc: WorkerProcess
    logs: RankLogs
    started_at: float
    state: str = "running"
    step: int = 0
    last_step_at: float | None = None
    iter_times: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    exception: dict[str, Any] | None = None
    exception_fatal: bool = False  # the exception ended the script (not a background thread's)
    exception_step: int = 0  # the rank's step when it came
    exitcode: int | None = None
    exited_at: float | None = None
    snapshot_step: int | None = None
    steps_in_attempt: int = 0
    hooked: bool = False  # said hello: its stack-dump signal handler is installed
    hello_at: float | None = None  # when (the worker's clock)
    joining: bool = False  # called init_process_group (it may not have returned: then not ``ready``)
    ready_at: float | None = None  # when it got past start-up (torch.distributed initialised)
    steps_expected: bool = False  # built an optimizer: it will report steps
    stateful: bool = False  # made a unicron.State: its steps start at the restored step, or 0
    exiting_code: int | None = None  # announced a non-zero SystemExit; not reaped yet
    exiting_at: float | None = None
    bye_at: float | None = None  # (monotonic) its script ended cleanly; the interpreter may still tear down
    closed: bool = False  # destroyed its default process group (since its last step): past its collectives
    closed_raising: bool = False  # ... with an exception on its way out (in a ``finally``): not an end
    # The exception (or exit code) it had in hand as it destroyed its group: on its way out in a
    # ``finally``, or already caught in an ``except`` that cleans up and goes on. Only its exit
    # tells (acceptance 27A F1): non-zero confirms it, a clean end drops it (see caught).
    fault_pending: bool = False
    lingering_named: bool = False  # said to have outlived its script (WorkerGroup.lingering_notices)
    alive_at: float | None = None  # (monotonic) its last ``alive``: said past its end (unicron.agent.frozen)
    alive_cpu_s: float | None = None  # its process's CPU seconds then
    frozen: str | None = None  # why it was killed as frozen past its end (its exit's message)

    @property
    def closed_cleanly(self) -> bool:
        """Destroyed its default process group at its end (not on an exception's way out)."""
        return self.closed and not self.closed_raising

    def caught(self) -> None:
        """The script went on after the destroy that a pending fault came with (it stepped, made a
        new group, or ended cleanly): the exception was caught, and was no failure."""
        if self.fault_pending:
            self.fault_pending = self.closed_raising = False
            self.exception, self.exception_fatal, self.exiting_code, self.exiting_at = None, False, None, None

    def note(self, t: Any, msg: dict[str, Any], at: float) -> bool:
        """Apply what a channel message of type ``t`` says of this rank, sent at ``at`` (the
        worker's clock). True when it completed a step."""
        if t == "hello":
            self.hooked = True
            self.hello_at = self.hello_at or at
        elif t == "exec":  # replaced its image: no hooks, no stack-dump handler, steps unknown
            self.hooked = False
        elif t == "init":
            self.joining = True
        elif t == "ready":
            self.ready_at = self.ready_at or at
        elif t == "optim":
            self.steps_expected = True
        elif t == "state":
            self.stateful = True
        elif t in ("closed", "opened"):
            self.closed = t == "closed"
            self.closed_raising = self.closed and msg.get("raising") is True
            if t == "opened":
                self.caught()
        elif t == "bye":
            self.bye_at = time.monotonic()
            self.caught()
        elif t == "exiting" and isinstance(msg.get("code"), int):
            pending = msg.get("pending") is True
            if not pending:
                self.caught()  # a sys.exit after the destroy: the exception in hand was caught
            self.exiting_code, self.exiting_at = (msg["code"] or None), at
            self.fault_pending = pending
            if msg.get("ready") is True:
                self.ready_at = self.ready_at or at
        elif t == "exc":
            fatal = msg.get("fatal") is not False  # False: a background thread's; the process goes on
            if fatal or not self.exception_fatal:  # a thread dying in teardown does not hide the cause
                # The worker's text, whatever it sent (a script can write to the channel): strings only.
                self.exception = {k: v if isinstance(v := msg.get(k), str) else "" for k in ("type", "msg", "tb")}
                self.exception_fatal, self.exception_step = fatal, self.step
                self.fault_pending = fatal and msg.get("pending") is True
            if msg.get("ready") is True:
                self.ready_at = self.ready_at or at
        elif t == "step" and isinstance(msg.get("step"), int):
            if self.last_step_at is not None and msg["step"] > self.step:
                self.iter_times.append(max(0.0, at - self.last_step_at) / (msg["step"] - self.step))
            if msg["step"] != self.step:
                self.steps_in_attempt += 1
            self.step = msg["step"]
            self.last_step_at = at
            self.closed = self.closed_raising = False  # a new process group after all
            self.caught()
            if isinstance(msg.get("snap"), int):
                self.snapshot_step = msg["snap"]
            return True
        return False


@dataclass(frozen=True)
class GroupSpec:
    attempt: int
    restart_count: int
    rank_offset: int
    world_size: int
    node_rank: int
    nnodes: int
    local_world_sizes: tuple[int, ...]
    master_addr: str
    master_port: int
    restore_step: int | None
    inject: str
    restore_note: str = ""  # why nothing is restored though snapshots were kept ("" otherwise)
    node_ids: frozenset[str] = frozenset()  # every node of the attempt (a replaced node is a new id)
    # ROLE_RANK of this node's first worker and ROLE_WORLD_SIZE: its ranks among the workers of
    # its --role, as torchrun numbers them (None: every node has one role, the global ones)
    role_offset: int | None = None
    role_world_size: int | None = None


def all_past_init(ranks: Iterable[RankState]) -> bool:
    """No rank is known to be still before or in ``init_process_group`` (so to need the
    attempt's store): each got past it, ended, or reports nothing (no hooks: unknown, taken as
    past it, as before this was asked)."""
    return all(r.ready_at is not None or r.last_step_at is not None or r.exitcode is not None or not r.hooked
               for r in ranks)  # a first step may come before "ready" is sent


def store_untouched(ranks: Iterable[RankState]) -> bool:
    """No rank has called ``init_process_group`` yet (so none has used the attempt's store):
    each reports through its hooks and none said it joined or is ready."""
    return all(r.hooked and not r.joining and r.ready_at is None for r in ranks)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[len(s) // 2], 5)


def status_rows(ranks: Iterable[RankState]) -> list[dict[str, Any]]:
    """Each rank as heartbeats carry it to ``unicron status``, in rank order."""
    out = []
    for r in sorted(ranks, key=lambda x: x.rank):
        times = list(r.iter_times)
        # One that raised (or called sys.exit with an error) is failing, though not reaped yet:
        # the stop waits for it to exit (acceptance 26A F5: shown running meanwhile).
        failing = r.state == "running" and not r.fault_pending and (r.exception_fatal or r.exiting_code is not None)
        out.append({"rank": r.rank, "local_rank": r.local_rank, "pid": r.proc.pid,
                    "state": "failed" if failing else r.state,
                    "step": r.step, "iter_time_s": median(times), "iter_times": [round(t, 4) for t in times],
                    "last_step_at": r.last_step_at, "snapshot_step": r.snapshot_step})
    return out
