"""Online iteration-time statistics and hang detection (pure: the clock is always passed in).

A synchronous job moves at the pace of its slowest rank, so the hang clock runs from the
moment the *slowest* rank last completed a step. After warm-up, a job whose ranks sit idle (no
CPU time, no I/O: waiting in a collective, a lock, a sleep) is hung when that gap exceeds
``max(k * running median iteration time, floor_s)``; while some rank of the job burns CPU with
its Python still (a long native call, a CUDA spin-wait) the longer ``max(busy_k * median,
busy_floor_s)`` applies instead; a rank whose Python keeps moving or that does I/O (an
evaluation, a checkpoint write) is working, which counts as progress.
During warm-up (the first ``warmup_steps`` steps of an attempt: imports, data loader start,
compilation, autotuning) the separate allowance ``first_step_timeout_s`` applies. See
docs/failures.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from unicron.detect.stepstats import StepStats

__all__ = ["HangDetector", "HangVerdict", "StepStats", "Straggler", "uneven_progress"]

LEAD_STEPS = 2  # steps ahead of the slowest rank that no lockstep job can be
RECURRING_K = 2.0  # times the job's recurring longest gap (StepStats.recurring_gap) it may go without a step
RESTART_START_K = 5.0  # a restarted attempt's idle ranks get this many times the start-up measured before
RESTART_START_FLOOR = 0.1  # ... and at least this fraction of the first-step timeout (30 s of 300)


def uneven_progress(steps: Mapping[Any, tuple[int, float]], now: float, within_s: float) -> bool:
    """Whether the ranks step unevenly: one is ``LEAD_STEPS`` or more steps ahead of the slowest
    (``steps``: rank -> (steps completed, when its last step came)) and stepped within
    ``within_s``. A lockstep job whose rank is stuck leaves the others at most one step ahead
    (the step in flight); ranks further ahead train on without the slow one (an uneven end: the
    short rank waits at a final barrier or in its tail). That is progress, not a hang."""
    if len(steps) < 2:
        return False
    slowest = min(step for step, _ in steps.values())
    return any(step >= slowest + LEAD_STEPS and now - at <= within_s for step, at in steps.values())


@dataclass(frozen=True)
class HangVerdict:
    """No progress for longer than allowed. ``stalled_ranks`` are oldest-progress first."""

    stalled_s: float
    threshold_s: float
    median_s: float | None
    warmup: bool
    stalled_ranks: tuple[int, ...]
    last_steps: dict[int, int | None]
    busy: bool = False  # some rank of the job was burning CPU with its Python still (the longer threshold)
    # The detector holds one node's ranks: in a job of several nodes the stalled ones named are
    # this node's, and the stuck rank may be another node's (the stack dump names it).
    one_node_of_several: bool = False
    # Silence of the first stalled rank before ``stalled_s`` that was not counted (the launcher
    # was stopped, the ranks ran a handler of a script signal): said, as the whole silence is.
    excused_s: float = 0.0
    # How the threshold was reached, naming the setting that raises it (HangDetector.basis):
    # a pause that is the script's own is then one flag away (acceptance 29A F3).
    basis: str = ""

    @property
    def message(self) -> str:
        ranks = ", ".join(map(str, self.stalled_ranks))
        basis = self.basis or f"threshold {self.threshold_s:.2f}s"
        whose = "this node's rank(s)" if self.one_node_of_several else "rank(s)"
        if self.excused_s >= 0.05:
            return (f"no step completed for {self.stalled_s + self.excused_s:.2f}s by {whose} {ranks}, "
                    f"{self.excused_s:.1f}s of it not counted (the launcher stopped, a script signal's or a debugger's "
                    f"hold, or the coordinator unheard) ({basis})")
        return f"no step completed for {self.stalled_s:.2f}s by {whose} {ranks} ({basis})"


@dataclass(frozen=True)
class Straggler:
    rank: int
    median_s: float
    others_median_s: float

    @property
    def ratio(self) -> float:
        return self.median_s / self.others_median_s if self.others_median_s > 0 else float("inf")


class HangDetector:
    """Calls a hang when the slowest rank makes no progress for too long."""

    def __init__(
        self,
        k: float = 3.0,
        floor_s: float = 2.0,
        warmup_steps: int = 2,
        first_step_timeout_s: float = 300.0,
        window: int = 50,
        busy_k: float = 5.0,
        busy_floor_s: float = 10.0,
        startup_hint_s: float | None = None,
    ) -> None:
        if k <= 0 or busy_k <= 0 or floor_s < 0 or busy_floor_s < 0 or first_step_timeout_s <= 0:
            raise ValueError("k, busy_k and first_step_timeout_s must be > 0, floors >= 0")
        if warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")
        self.k = k
        self.floor_s = floor_s
        self.busy_k = busy_k
        self.busy_floor_s = busy_floor_s
        self.warmup_steps = warmup_steps
        self.first_step_timeout_s = first_step_timeout_s
        # How long an earlier attempt of this job took from its start to every rank's first step.
        self.startup_hint_s = startup_hint_s
        self.stats = StepStats(window=window, skip_first=max(warmup_steps, 1))
        self._stepless_checked = False

    def start(self, now: float, ranks: Iterable[int]) -> None:
        self.stats.start(now, ranks)
        self._stepless_checked = False

    def forget_stepless(self, stepper: int, expects_steps: Callable[[int], bool]) -> list[int]:
        """Once ``stepper`` is past warm-up (checked once an attempt), stop waiting for the
        first step of ranks that neither stepped nor built an optimizer (``expects_steps``):
        an RL actor, an evaluator or a data-serving rank never steps, and would keep the whole
        job under the first-step allowance (minutes) for good. Its own stall shows as the
        steppers' stall, which the stack dump then blames on it. Returns the ranks let go."""
        if self._stepless_checked or self.stats.steps_in_attempt(stepper) <= max(self.warmup_steps, 1):
            return []
        self._stepless_checked = True
        gone = [r for r in self.stats.ranks if self.stats.steps_in_attempt(r) == 0 and not expects_steps(r)]
        for rank in gone:
            self.stats.remove(rank)
        return gone

    def expect(self, rank: int, now: float) -> None:
        """Wait for ``rank``'s steps again from ``now`` (let go by ``forget_stepless``, it built an
        optimizer after all); nothing for a rank already expected."""
        if rank not in self.stats.ranks:
            self.stats.observe_start(rank, now)

    def observe(self, rank: int, step: int, now: float) -> bool:
        return self.stats.observe(rank, step, now)

    def remove(self, rank: int) -> None:
        self.stats.remove(rank)

    def paused(self, gap_s: float, now: float | None = None) -> None:
        """The agent itself was stopped for ``gap_s`` (see ``StepStats.paused``)."""
        self.stats.paused(gap_s, now)

    def in_warmup(self) -> bool:
        # The first step of an attempt always gets the allowance: it pays for start-up.
        ranks = self.stats.ranks
        return (
            any(self.stats.steps_in_attempt(r) < max(self.warmup_steps, 1) for r in ranks)
            or self.stats.job_median() is None
        )

    def _k_floor(self, busy: bool) -> tuple[float, float]:
        """The factor and floor in force: the busy ones never below the idle ones."""
        return (max(self.k, self.busy_k), max(self.floor_s, self.busy_floor_s)) if busy else (self.k, self.floor_s)

    def threshold_s(self, busy: bool = False) -> tuple[float, bool]:
        """The allowed gap without progress now, and whether it is the warm-up allowance.

        ``busy``: some rank of the job burns CPU with its Python still. The busy threshold is
        never below the idle one, so raising ``floor_s`` or ``k`` always buys time.

        Before every rank has completed a step: ``first_step_timeout_s`` (imports, data
        loading, compilation). During the rest of warm-up the running median is not known yet,
        but the longest gap seen so far is (start-up included, so it is generous): k times it,
        at least ``floor_s``, at most ``first_step_timeout_s``. A hang right after the first
        steps is then found in about k x (start-up time), not after the first-step timeout.
        """
        median = self.stats.job_median()
        if not self.stats.started_all():
            return self.first_step_allowance_s(busy), True
        k, floor = self._k_floor(busy)
        if self.in_warmup() or median is None:
            early = max(k * self.stats.longest_interval(), floor)
            return min(early, self.first_step_timeout_s), True
        recurring = self.stats.recurring_gap() or 0.0
        return max(k * median, RECURRING_K * recurring, floor), False

    def startup_sampling_s(self) -> float:
        """From when (since the attempt's start) the ranks' activity is gathered before every
        rank's first step: work seen after it (Python moving, I/O, batches) restarts the clock,
        so a long preprocessing or a restart's slow restore is not a hang; late enough that a
        start-up of ordinary length is never sampled."""
        return 0.4 * self.first_step_allowance_s()

    def first_step_allowance_s(self, busy: bool = False) -> float:
        """The allowance before every rank's first step: ``first_step_timeout_s``; for an attempt
        after one that started (``startup_hint_s``) while every rank sits idle, at most
        ``RESTART_START_K`` times that start-up, at least ``RESTART_START_FLOOR`` of
        ``first_step_timeout_s`` (so raising the timeout raises both). A restarted
        attempt does what the earlier one did to start (its ranks restore instead of initialise),
        and ranks that all wait, none computing or reading, are stuck: a peer that never arrives,
        a deadlock in restore. Found in seconds, not after the first-step timeout. A rank that
        burns CPU (compilation) or does I/O (loading data) keeps the whole allowance."""
        if self.startup_hint_s is None or busy:
            return self.first_step_timeout_s
        floor = RESTART_START_FLOOR * self.first_step_timeout_s
        return min(self.first_step_timeout_s, max(RESTART_START_K * self.startup_hint_s, floor))

    def overdue_s(self, now: float) -> float:
        """How long the slowest rank has gone without progress (0 with no ranks)."""
        last = self.stats.last_progress_all()
        return max(0.0, now - min(last.values())) if last else 0.0

    def quiet_s(self, now: float) -> float:
        """How long from ``now`` ``check`` cannot return a verdict unless a step or some rank's
        activity changes it first (inf with no ranks): the idle threshold less the time the
        slowest rank is overdue. The busy threshold is never shorter and activity marks only move
        progress later, so a caller may sleep this long (see the agent's loop)."""
        if not self.stats.ranks:
            return float("inf")
        return max(0.0, self.threshold_s(busy=False)[0] - self.overdue_s(now))

    def check(self, now: float, busy: bool = False, working_at: float | None = None,
              busy_at: float | None = None, outside: bool = False) -> HangVerdict | None:
        """A verdict while the job is hung (every call, until ``start`` begins a new attempt).

        ``busy``: some rank of the job is using CPU now (see ``unicron.detect.activity``); it
        selects the longer threshold. ``working_at``: when some rank of the job was last seen
        working (Python moving, or I/O) between steps; that counts as progress of every rank.
        ``busy_at``: when some rank was last seen busy; once the job is idle, the idle
        threshold runs from then (a long native call that ends is not a stall of its length).
        ``outside``: every rank's stack was seen outside any collective during this stall, so it
        is judged by the busy threshold (with ``busy``; the agent's ``WorkerGroup.check_hang``).
        """
        ranks = self.stats.ranks
        if not ranks:
            return None
        threshold, warmup = self.threshold_s(busy)
        last = self.stats.last_progress_all()
        marks = [t for t in (working_at, None if busy else busy_at) if t is not None]
        if marks:
            last = {r: max(ts, max(marks)) for r, ts in last.items()}
        stalled = sorted((r for r in ranks if now - last[r] > threshold), key=lambda r: (last[r], r))
        if not stalled:
            return None
        own = self.stats.last_progress(stalled[0]) == last[stalled[0]]  # not a mark's later time
        return HangVerdict(
            excused_s=self.stats.excused_s(stalled[0]) if own else 0.0,
            stalled_s=now - last[stalled[0]],
            threshold_s=threshold,
            median_s=self.stats.job_median(),
            warmup=warmup,
            stalled_ranks=tuple(stalled),
            last_steps={r: self.stats.last_step(r) for r in ranks},
            busy=busy,
            basis=self.basis(threshold, warmup, busy, outside),
        )

    def basis(self, threshold_s: float, warmup: bool, busy: bool, outside: bool = False) -> str:
        """The threshold in words: what it is the largest of, with the flag that raises each."""
        floor_flag = "--hang-busy-floor" if busy else "--hang-floor"
        k, floor = self._k_floor(busy)
        while_ = "no rank waited in a collective" if outside else "busy" if busy else "idle"
        if warmup and not self.stats.started_all():
            return (f"warm-up allowance {threshold_s:.1f}s{', busy' if busy else ''}: before every rank's first "
                    f"step, up to --first-step-timeout {self.first_step_timeout_s:g}s")
        if warmup:
            return (f"warm-up allowance {threshold_s:.1f}s{', busy' if busy else ''}: {k:g} x the longest gap "
                    f"so far {self.stats.longest_interval():.3f}s, at least {floor_flag} {floor:g}s")
        median = self.stats.job_median()
        parts = [f"{k:g} x median step {median:.3f}s" if median is not None else None]
        recurring = self.stats.recurring_gap()
        if recurring is not None and RECURRING_K * recurring > k * (median or 0.0):
            parts.append(f"{RECURRING_K:g} x the recurring gap {recurring:.3f}s")
        parts.append(f"{floor_flag} {floor:g}s")
        return f"allowed {threshold_s:.2f}s while {while_}: the largest of " + ", ".join(p for p in parts if p)

    def stragglers(self, factor: float = 2.0, min_samples: int = 5, min_gap_s: float = 0.01) -> list[Straggler]:
        """Ranks whose median iteration time is over ``factor`` x the median of the others' medians.

        Only meaningful where ranks are not lock-stepped by collectives: in synchronous data
        parallel training every rank's step boundary waits for the slowest, so all medians agree
        (the slow rank is then found by stack sampling: it is the one outside the collective).
        """
        medians = {
            r: m for r in self.stats.ranks
            if self.stats.samples(r) >= min_samples and (m := self.stats.median(r)) is not None
        }
        found = []
        for rank, median in medians.items():
            others = [m for r, m in medians.items() if r != rank]
            if not others:
                continue
            base = statistics.median(others)
            if median > factor * base and median - base >= min_gap_s:
                found.append(Straggler(rank, median, base))
        return sorted(found, key=lambda s: -s.ratio)
