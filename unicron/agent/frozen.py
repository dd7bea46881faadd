"""A rank frozen past its last step: its Python cannot run, and it uses no CPU.

Once a rank has destroyed its default process group or its script has ended, the hang detector
leaves it alone: what it does then (an upload, ``wandb.finish()``, a long teardown) is its own
tail, as under torchrun. But a rank can also freeze there for good: a thread blocked in native
code while it holds the interpreter lock. torch 2.x has such a deadlock in its teardown (the main
thread frees a DDP reducer and joins gloo's work thread, which waits for the lock to free a
Python object that a finished collective held; acceptance 31A F1): the job trained, its other
ranks exited 0, and the launcher waited for ever, as torchrun does.

Past its end (its default group destroyed, its script still running), a rank's liveness
thread says ``alive`` every ``ALIVE_S`` (``unicron.worker.liveness``): a Python thread, it runs whenever the lock is free, whatever the main thread waits
for (a sleep, a socket, a non-daemon thread). Silence alone is not enough (a long native
computation holding the lock is work): the rank is frozen once it has said nothing for
``FROZEN_FACTOR`` x the busy floor (``--hang-busy-floor``, the time any busy rank is given: 30 s)
while its process used less than ``MAX_CPU_SHARE`` of a core: a teardown that waits that long
without a thread of Python or a CPU cycle (an NCCL communicator's destroy takes seconds) is no
teardown. A stopped or traced process (SIGSTOP, a debugger) is not frozen.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from unicron.agent.proctree import process_state, stat_fields
from unicron.agent.ranks import RankState
from unicron.detect.classify import FROZEN_KILL

FROZEN_FACTOR = 3.0  # x --hang-busy-floor
MAX_CPU_SHARE = 0.02  # of one core over the silence: a deadlock uses none; computing with the lock, all
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def frozen_limit_s(busy_floor_s: float) -> float:
    return FROZEN_FACTOR * busy_floor_s


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``'s threads (not its children); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = stat_fields(fh.read())
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)
    except (OSError, ValueError, IndexError):
        return None


def past_its_end(r: RankState) -> bool:
    """Destroyed its default group cleanly and its script has not ended: once it has, the
    interpreter finalizes, when daemon threads can no longer take the lock, so a ``__del__`` that
    waits would look frozen (32A F4)."""
    return r.exitcode is None and r.closed_cleanly and r.bye_at is None and r.alive_at is not None


def frozen_for(r: RankState, mono: float, cpu_s: float | None) -> float | None:
    """How long ``r`` (past its end) has been frozen: silent since its last ``alive`` and using
    (almost) no CPU since; None while it is not."""
    if not past_its_end(r) or r.alive_at is None or r.alive_cpu_s is None or cpu_s is None:
        return None
    silent_s = mono - r.alive_at
    if silent_s <= 0 or cpu_s - r.alive_cpu_s > MAX_CPU_SHARE * silent_s:
        return None
    return silent_s


def excuse_pause(ranks: Iterable[RankState], gap_s: float) -> None:
    """The agent did not run for ``gap_s`` (SIGSTOP, a VM pause): the ranks' ``alive`` ticks of
    that time may still be on their way through zmq's I/O thread when the watch runs again, so
    their silence clocks move on by the gap (32A F3), as the hang clocks do."""
    for r in ranks:
        if r.alive_at is not None:
            r.alive_at += gap_s


def frozen_ranks(ranks: Iterable[RankState], mono: float, limit_s: float) -> list[tuple[RankState, float]]:
    """The ranks past their end frozen for ``limit_s`` or more, with how long, each once."""
    out = []
    for r in ranks:
        if r.frozen is not None or not past_its_end(r) or r.alive_at is None or mono - r.alive_at < limit_s:
            continue
        silent_s = frozen_for(r, mono, process_cpu_s(r.proc.pid))
        if silent_s is not None and silent_s >= limit_s and process_state(r.proc.pid) not in "tTZX?":
            out.append((r, silent_s))
    return out


def next_frozen_check_s(ranks: Iterable[RankState], mono: float, limit_s: float) -> float:
    """Seconds until a rank past its end could be frozen for ``limit_s`` (inf: none can)."""
    return min((r.alive_at + limit_s - mono for r in ranks
                if r.frozen is None and past_its_end(r) and r.alive_at is not None), default=float("inf"))


def frozen_notice(r: RankState, silent_s: float, busy_floor_s: float) -> str:
    return (f"rank {r.rank} (pid {r.proc.pid}) froze after it destroyed its process group: no Python ran in it for {silent_s:.1f}s "
            f"({FROZEN_FACTOR:g} x --hang-busy-floor {busy_floor_s:g}s) and it used no CPU, so a thread blocked in native code holds "
            f"the interpreter lock (as in torch's teardown deadlock after destroy_process_group); stack kept, {FROZEN_KILL}")
