"""Per-rank step progress and a running window of iteration times (pure: times are passed in).

What the hang detector (``unicron.detect.hang``) judges by: each rank's last progress, the
per-step intervals whose median is the job's pace, and the whole gaps between steps whose
recurring longest is the pace of a loop that steps in bursts.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

GAP_WINDOW = 1024  # whole gaps kept per rank for the recurring gap (StepStats.recurring_gap)


@dataclass
class _RankProgress:
    last_progress_ts: float  # last completed step, or the attempt start before the first one
    last_step: int | None = None
    steps_in_attempt: int = 0
    times: deque[float] = field(default_factory=deque)
    gaps: deque[float] = field(default_factory=deque)  # the same intervals whole (not per step)
    top2: list[float] = field(default_factory=list)  # the two longest of ``gaps``, longest first
    longest_s: float = 0.0  # longest gap between progress reports this attempt (first one included)
    first_step_ts: float | None = None  # when its first step of the attempt came
    excused_s: float = 0.0  # of its silence since that progress, what ``paused`` took off its clock


class StepStats:
    """Per-rank step progress and a running window of iteration times.

    The interval ending at a rank's n-th step of the attempt is recorded only when
    n > ``skip_first``: the first steps include start-up cost and would inflate the median.
    """

    def __init__(self, window: int = 50, skip_first: int = 1) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        if skip_first < 0:
            raise ValueError("skip_first must be >= 0")
        self.window = window
        self.skip_first = skip_first
        self._ranks: dict[int, _RankProgress] = {}
        self.started_at: float | None = None

    def start(self, now: float, ranks: Iterable[int] = ()) -> None:
        """Forget everything and expect ``ranks`` (a new attempt begins at ``now``)."""
        self.started_at = now
        self._ranks = {r: _RankProgress(now, times=deque(maxlen=self.window), gaps=deque(maxlen=GAP_WINDOW)) for r in ranks}

    def _progress(self, rank: int, ts: float) -> _RankProgress:
        if rank not in self._ranks:  # a rank not announced by start(): its clock starts now
            start = ts if self.started_at is None else min(ts, self.started_at)
            self._ranks[rank] = _RankProgress(start, times=deque(maxlen=self.window), gaps=deque(maxlen=GAP_WINDOW))
        return self._ranks[rank]

    def observe(self, rank: int, step: int, ts: float) -> bool:
        """Record that ``rank`` has completed ``step`` steps at ``ts``; False if that is not progress."""
        p = self._progress(rank, ts)
        if p.last_step is not None and step <= p.last_step:
            return False  # duplicate or reordered report
        advanced = 1 if p.last_step is None else step - p.last_step
        p.longest_s = max(p.longest_s, ts - p.last_progress_ts)
        if p.first_step_ts is None:
            p.first_step_ts = ts
        if p.last_step is not None and p.steps_in_attempt + advanced > self.skip_first:
            p.times.append(max(ts - p.last_progress_ts, 0.0) / advanced)
        if p.last_step is not None:  # warm-up's gaps too: a burst loop's waits must be seen early
            _add_gap(p, max(ts - p.last_progress_ts, 0.0))
        p.last_step = step
        if ts >= p.last_progress_ts:
            p.excused_s = 0.0
        p.last_progress_ts = max(ts, p.last_progress_ts)
        p.steps_in_attempt += advanced
        return True

    def paused(self, gap_s: float, now: float | None = None) -> None:
        """The observer was not running for ``gap_s`` (or what it waited on was silent): no
        rank's silence in that time counts. Their progress clocks move on by it, never past
        ``now``: a rank that stepped meanwhile gets no credit beyond the present (a clock in the
        future would hide a hang that long, and turn the steps before it into 0 s samples)."""
        for p in self._ranks.values():
            moved = p.last_progress_ts + gap_s
            moved = max(p.last_progress_ts, moved if now is None else min(moved, now))
            p.excused_s += moved - p.last_progress_ts
            p.last_progress_ts = moved

    def excused_s(self, rank: int) -> float:
        """How much of ``rank``'s silence since its last progress ``paused`` did not count."""
        p = self._ranks.get(rank)
        return p.excused_s if p is not None else 0.0

    def remove(self, rank: int) -> None:
        """Stop expecting ``rank`` (it finished cleanly or was taken out of the job)."""
        self._ranks.pop(rank, None)

    def observe_start(self, rank: int, now: float) -> None:
        """Expect ``rank``'s first step, its clock starting at ``now``."""
        self._ranks.setdefault(rank, _RankProgress(now, times=deque(maxlen=self.window), gaps=deque(maxlen=GAP_WINDOW)))

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def median(self, rank: int) -> float | None:
        p = self._ranks.get(rank)
        return statistics.median(p.times) if p is not None and p.times else None

    def job_median(self) -> float | None:
        """The job's pace: the largest per-rank median (the slowest rank sets the pace)."""
        medians = [m for m in (self.median(r) for r in self._ranks) if m is not None]
        return max(medians) if medians else None

    def recurring_gap(self) -> float | None:
        """The job's longest gap between steps that came more than once in the last
        ``GAP_WINDOW`` gaps: the second-longest gap of each rank, the largest of them (None
        before two gaps). The window is long so that bursts of many steps (60 minibatches per
        rollout) keep two of their waits in it (acceptance 30A F3: with the median's 50, they
        were pushed out and every wait was a hang again).

        A loop that steps in bursts (an RL script that waits for rollouts, then steps its
        optimizer four times) has a median gap near zero; its iteration is the wait. A gap
        seen twice is the loop's own rhythm, while a one-off (an evaluation) is not."""
        seconds = [p.top2[1] for p in self._ranks.values() if len(p.top2) >= 2]
        return max(seconds) if seconds else None

    def longest_interval(self) -> float:
        """The longest gap between progress reports of any rank this attempt (start-up included)."""
        return max((p.longest_s for p in self._ranks.values()), default=0.0)

    def started_all(self) -> bool:
        """Every expected rank has completed at least one step this attempt."""
        return bool(self._ranks) and all(p.steps_in_attempt > 0 for p in self._ranks.values())

    def startup_s(self) -> float | None:
        """From the attempt's start to the last rank's first step (None until every rank stepped)."""
        if self.started_at is None or not self.started_all():
            return None
        return max(0.0, max(p.first_step_ts or 0.0 for p in self._ranks.values()) - self.started_at)

    def samples(self, rank: int) -> int:
        p = self._ranks.get(rank)
        return len(p.times) if p is not None else 0

    def iter_times(self, rank: int) -> list[float]:
        p = self._ranks.get(rank)
        return list(p.times) if p is not None else []

    def last_step(self, rank: int) -> int | None:
        p = self._ranks.get(rank)
        return p.last_step if p is not None else None

    def last_progress(self, rank: int) -> float | None:
        p = self._ranks.get(rank)
        return p.last_progress_ts if p is not None else None

    def last_progress_all(self) -> dict[int, float]:
        return {r: p.last_progress_ts for r, p in self._ranks.items()}

    def steps_in_attempt(self, rank: int) -> int:
        p = self._ranks.get(rank)
        return p.steps_in_attempt if p is not None else 0


def _add_gap(p: _RankProgress, gap: float) -> None:
    """Append ``gap``, keeping ``top2`` without a scan of the window for each step (the agent
    asks for the threshold far more often than a step comes): only a gap that leaves the window
    as one of the two longest makes it look again."""
    dropped = p.gaps[0] if p.gaps.maxlen is not None and len(p.gaps) == p.gaps.maxlen else None
    p.gaps.append(gap)
    if dropped is not None and p.top2 and dropped >= p.top2[-1]:
        p.top2 = heapq.nlargest(2, p.gaps)
    else:
        p.top2 = heapq.nlargest(2, [*p.top2, gap])
