"""Fault injection for tests and demos: ``UNICRON_INJECT`` / ``unicron run --inject``.

Spec grammar (several specs separated by ``;``)::

    KIND@RANK:STEP        KIND  = kill | hang | freeze | exception | exit[=CODE] | slow[=SECONDS]
                          RANK  = global rank, or * for every rank
                          STEP  = completed steps at which the fault fires

A fault fires on the worker whose ``RANK`` matches, at the iteration boundary reached when
STEP steps have completed (STEP 0: at worker start, before the script runs):

- ``kill``       SIGKILL to itself (no Python cleanup, like the OOM killer)
- ``hang``       blocks forever in Python (a stack dump shows this module's ``hang_forever``)
- ``freeze``     SIGSTOP to itself: the process stops whole, gives no stack dump and ignores
                 SIGTERM until continued (a debugger's stop, a job-control suspend, a node frozen)
- ``exception``  raises RuntimeError("CUDA error: an illegal memory access was encountered ...")
- ``exit=CODE``  ``os._exit(CODE)`` (default 1)
- ``slow=S``     spins on a CPU for S seconds (default 1.0) at every boundary from STEP on (a straggler)

Nothing here is active unless ``UNICRON_INJECT`` is set. Parsing and the decision of what fires
when (``faults_at``) are pure; ``fire`` is the thin part that does harm.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from unicron.errors import UsageError

KINDS = ("kill", "hang", "freeze", "exception", "exit", "slow")
DEFAULT_EXIT_CODE = 1
DEFAULT_SLOW_S = 1.0
INJECTED_CUDA_ERROR = "CUDA error: an illegal memory access was encountered (injected by unicron)"
INJECTED_KILL = "SIGKILL to itself (--inject kill)"  # in the notice: the classifier tells this kill by it
_WHAT = {"kill": INJECTED_KILL, "hang": "sleeps for ever (--inject hang)", "freeze": "SIGSTOP to itself (--inject freeze)",
         "exception": "raises a CUDA-like RuntimeError (--inject exception)"}

_SPEC = re.compile(r"^(?P<kind>[a-z]+)(?:=(?P<value>[^@]*))?@(?P<rank>\*|\d+):(?P<step>\d+)$")
_GRAMMAR = ("expected KIND@RANK:STEP (RANK a global rank or *) with KIND in kill, hang, freeze, exception, "
            "exit[=CODE], slow[=SECONDS]")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: every rank
    step: int
    value: float | int | None = None  # exit code or slow seconds

    def __str__(self) -> str:
        kind = self.kind if self.value is None else f"{self.kind}={self.value}"
        return f"{kind}@{'*' if self.rank is None else self.rank}:{self.step}"

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse_fault(part: str) -> Fault:
    """One ``KIND@RANK:STEP`` spec; raises UsageError naming it and what is wrong."""
    m = _SPEC.match(part)
    if m is None:
        raise UsageError(f"bad fault spec {part!r}: {_GRAMMAR}")
    kind, raw, rank_s, step_s = m["kind"], m["value"], m["rank"], m["step"]
    if kind not in KINDS:
        raise UsageError(f"bad fault spec {part!r}: unknown kind {kind!r}; {_GRAMMAR}")
    rank = None if rank_s == "*" else int(rank_s)
    step = int(step_s)
    if raw is None:
        value: float | int | None = {"exit": DEFAULT_EXIT_CODE, "slow": DEFAULT_SLOW_S}.get(kind)
        return Fault(kind, rank, step, value)
    if kind == "exit":
        if not (raw.isascii() and raw.isdigit()) or not 0 <= int(raw) <= 255:
            raise UsageError(f"bad fault spec {part!r}: exit code must be an integer 0..255")
        return Fault(kind, rank, step, int(raw))
    if kind == "slow":
        try:
            seconds = float(raw)
        except ValueError:
            seconds = -1.0
        if not 0 < seconds < 1e6:
            raise UsageError(f"bad fault spec {part!r}: slow needs a number of seconds above 0 and below 1e6")
        return Fault(kind, rank, step, seconds)
    raise UsageError(f"bad fault spec {part!r}: {kind} takes no value")


def parse_inject_spec(spec: str) -> list[Fault]:
    """Parse ``KIND@RANK:STEP[;...]``; raises UsageError naming the bad part."""
    parts = [p.strip() for p in spec.split(";")]
    faults = [parse_fault(p) for p in parts if p]
    if not faults:
        raise UsageError(f"empty fault spec {spec!r}: {_GRAMMAR}")
    return faults


def format_inject_spec(faults: Sequence[Fault]) -> str:
    """Inverse of parse_inject_spec (what the agent puts in ``UNICRON_INJECT``)."""
    return ";".join(str(f) for f in faults)


def faults_at(faults: Sequence[Fault], rank: int, completed: int) -> list[Fault]:
    """Faults that fire on ``rank`` at the boundary after ``completed`` steps.

    ``slow`` comes first (it delays; the others end or stop the worker) and fires at every
    boundary from its step on; the others fire exactly at their step.
    """
    due = [
        f
        for f in faults
        if f.applies_to(rank) and (completed >= f.step if f.kind == "slow" else completed == f.step)
    ]
    return sorted(due, key=lambda f: f.kind != "slow")


def hang_forever() -> None:
    """Block forever in Python, so a stack dump points here and not into a collective."""
    while True:
        time.sleep(1.0)


_announced: set[Fault] = set()


def notice(fault: Fault, rank: int, completed: int) -> str:
    """The line a rank writes to its stderr as it injects ``fault``: which, where, when. A fault
    the user did not see announced read like a real one (only kill said anything: 29C F12)."""
    if fault.kind == "exit":
        what = f"exits with code {fault.value if fault.value is not None else DEFAULT_EXIT_CODE} (--inject exit)"
    elif fault.kind == "slow":
        what = f"computes {float(fault.value or DEFAULT_SLOW_S):g} s longer every step from here (--inject slow)"
    else:
        what = _WHAT[fault.kind]
    when = "before its first step" if completed == 0 else f"after step {completed}"
    return f"unicron: {time.strftime('%H:%M:%S')} injected fault on rank {rank} {when}: {what}"


def fire(fault: Fault, rank: int = -1, completed: int = 0) -> None:
    """Make the fault happen in this process, saying so first on its stderr (``slow`` once)."""
    if fault not in _announced:
        if fault.kind == "slow":
            _announced.add(fault)  # it fires at every step from its own on
        sys.stderr.write(notice(fault, rank, completed) + "\n")
        sys.stderr.flush()
    if fault.kind == "slow":
        # A straggler computes for longer, it does not sleep: spin, so the hang detector sees a
        # busy rank (a sleeping one is an idle stall, and may rightly be called a hang).
        end = time.monotonic() + float(fault.value or DEFAULT_SLOW_S)
        while time.monotonic() < end:
            pass
    elif fault.kind == "kill":
        # Let the report of the step that just completed reach the agent first, so the record
        # ("exit on rank R at step S") does not depend on a race with the kill.
        from unicron.worker import channel

        channel.get().close()  # (the notice above lets the decision tell this kill from the OOM killer's: 28C F3)
        os.kill(os.getpid(), signal.SIGKILL)
        hang_forever()  # SIGKILL is delivered asynchronously; never run on past the fault
    elif fault.kind == "hang":
        hang_forever()
    elif fault.kind == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "exception":
        raise RuntimeError(INJECTED_CUDA_ERROR)
    elif fault.kind == "exit":
        code = int(fault.value if fault.value is not None else DEFAULT_EXIT_CODE)
        os._exit(code)  # the worker hooks' os._exit flushes the channel first, as for any exit
