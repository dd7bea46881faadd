"""Hang detection and iteration statistics, driven by a fake clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unicron.detect.hang import HangDetector, StepStats


def run_steps(det: HangDetector, ranks: list[int], steps: int, dt: float, t0: float, step0: int = 0) -> float:
    """Every rank completes ``steps`` steps ``dt`` apart starting after ``t0``; returns the time."""
    now = t0
    for s in range(step0 + 1, step0 + steps + 1):
        now += dt
        for r in ranks:
            det.observe(r, s, now)
        assert det.check(now) is None, f"false hang at step {s}"
    return now


def test_stats_median_window_and_skip_first() -> None:
    stats = StepStats(window=3, skip_first=1)
    stats.start(0.0, [0])
    for step, ts in [(1, 10.0), (2, 11.0), (3, 13.0), (4, 16.0), (5, 20.0)]:
        assert stats.observe(0, step, ts)
    # The first interval (start -> step 1, 10 s of start-up) is skipped; the window keeps 3.
    assert stats.iter_times(0) == [2.0, 3.0, 4.0]
    assert stats.median(0) == 3.0
    assert not stats.observe(0, 5, 21.0), "a repeated step is not progress"
    assert not stats.observe(0, 4, 22.0), "an older step is not progress"
    assert stats.last_progress(0) == 20.0
    # A jump of several steps in one report is spread over them.
    stats.observe(0, 8, 26.0)
    assert stats.iter_times(0)[-1] == 2.0


def test_no_false_hang_in_steady_state_then_hang_after_k_median() -> None:
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1, 2])
    now = run_steps(det, [0, 1, 2], 30, dt=1.0, t0=5.0)
    threshold, warmup = det.threshold_s()
    assert not warmup and threshold == pytest.approx(3.0)
    assert det.check(now + 2.9) is None
    verdict = det.check(now + 3.1)
    assert verdict is not None and not verdict.warmup
    assert verdict.stalled_ranks == (0, 1, 2)
    assert verdict.stalled_s == pytest.approx(3.1)
    assert verdict.median_s == pytest.approx(1.0)
    assert "3.10s" in verdict.message


def test_floor_applies_to_fast_steps() -> None:
    det = HangDetector(k=3.0, floor_s=2.0, warmup_steps=1, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 20, dt=0.01, t0=1.0)
    assert det.threshold_s() == (2.0, False)
    assert det.check(now + 1.9) is None
    assert det.check(now + 2.1) is not None


def test_slowest_rank_sets_the_clock_and_is_named() -> None:
    det = HangDetector(k=3.0, floor_s=0.1, warmup_steps=1, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1, 2])
    now = run_steps(det, [0, 1, 2], 10, dt=1.0, t0=0.0)
    # Rank 1 stops; the others still report (e.g. a loosely coupled job).
    for s in range(11, 16):
        now += 1.0
        det.observe(0, s, now)
        det.observe(2, s, now)
    verdict = det.check(now)
    assert verdict is not None and verdict.stalled_ranks == (1,)
    assert verdict.last_steps == {0: 15, 1: 10, 2: 15}


def test_warmup_allowance_before_first_steps() -> None:
    det = HangDetector(k=3.0, floor_s=1.0, warmup_steps=2, first_step_timeout_s=30.0)
    det.start(100.0, [0, 1])
    assert det.threshold_s() == (30.0, True)
    assert det.check(129.0) is None
    verdict = det.check(131.0)
    assert verdict is not None and verdict.warmup and verdict.stalled_ranks == (0, 1)
    assert "warm-up" in verdict.message
    # A slow first step (compilation) within the allowance is no hang.
    det.start(200.0, [0, 1])
    det.observe(0, 1, 225.0)
    det.observe(1, 1, 225.5)
    assert det.check(250.0) is None, "still in warm-up: the allowance runs from the last progress"
    det.observe(0, 2, 226.0)
    det.observe(1, 2, 226.0)
    assert det.in_warmup(), "no iteration time measured after warm-up yet"
    det.observe(0, 3, 227.0)
    det.observe(1, 3, 227.0)
    assert not det.in_warmup()
    assert det.threshold_s() == (3.0, False)
    assert det.check(230.5) is not None


def test_rank_that_never_reports_hangs_after_allowance() -> None:
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=0, first_step_timeout_s=10.0)
    det.start(0.0, [0, 1])
    now = 0.0
    for s in range(1, 6):
        now += 1.0
        det.observe(0, s, now)
    verdict = det.check(10.5)
    assert verdict is not None and verdict.warmup and verdict.stalled_ranks == (1,)


def test_restart_resets_statistics_and_restored_step_numbers_work() -> None:
    det = HangDetector(k=2.0, floor_s=0.1, warmup_steps=1, first_step_timeout_s=5.0)
    det.start(0.0, [0])
    run_steps(det, [0], 20, dt=1.0, t0=0.0)
    det.start(100.0, [0])  # new attempt, restored at step 20
    assert det.in_warmup() and det.stats.iter_times(0) == []
    now = run_steps(det, [0], 10, dt=0.1, t0=100.0, step0=20)
    assert det.threshold_s() == (pytest.approx(0.2), False)
    assert det.check(now + 0.25) is not None


def test_removed_rank_is_not_waited_for() -> None:
    det = HangDetector(k=3.0, floor_s=0.1, warmup_steps=0, first_step_timeout_s=5.0)
    det.start(0.0, [0, 1])
    det.observe(0, 1, 1.0)
    det.remove(1)
    assert det.check(4.0) is None
    det.remove(0)
    assert det.check(1000.0) is None


def test_straggler_signal() -> None:
    det = HangDetector(k=3.0, floor_s=1.0, warmup_steps=1, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1, 2, 3])
    times = {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0}
    pace = {0: 0.1, 1: 0.11, 2: 0.5, 3: 0.1}
    for s in range(1, 20):
        for r in times:
            times[r] += pace[r]
            det.observe(r, s, times[r])
    found = det.stragglers(factor=2.0, min_samples=5)
    assert [s.rank for s in found] == [2]
    assert found[0].ratio == pytest.approx(5.0, rel=0.1)
    assert det.stragglers(factor=10.0) == []


@pytest.mark.parametrize("kwargs", [
    {"k": 0}, {"floor_s": -1}, {"first_step_timeout_s": 0}, {"warmup_steps": -1}, {"window": 0},
])
def test_bad_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        HangDetector(**kwargs)  # type: ignore[arg-type]


@given(
    intervals=st.lists(st.floats(min_value=0.001, max_value=10.0), min_size=5, max_size=60),
    k=st.floats(min_value=1.5, max_value=10.0),
    floor=st.floats(min_value=0.0, max_value=5.0),
)
def test_never_a_hang_while_steps_arrive_within_the_threshold(intervals: list[float], k: float, floor: float) -> None:
    """Steps arriving exactly at the pace the statistics have seen are never called a hang,
    and silence past the threshold always is."""
    det = HangDetector(k=k, floor_s=floor, warmup_steps=1, first_step_timeout_s=100.0)
    det.start(0.0, [0])
    now = 0.0
    for step, dt in enumerate([1.0, *intervals, *intervals], start=1):
        limit, _ = det.threshold_s()
        if dt <= limit * 0.999:  # clear of floating-point rounding at the edge
            now += dt
            assert det.check(now) is None
            det.observe(0, step, now)
    limit, _ = det.threshold_s()
    assert det.check(now + limit * 0.999) is None
    verdict = det.check(now + limit * 1.001 + 1e-6)
    assert verdict is not None and verdict.threshold_s == limit


def test_hang_right_after_the_first_steps_uses_the_early_allowance() -> None:
    """Before the median is known, a stall is judged against k x the longest gap seen so far
    (start-up included), not the long first-step timeout."""
    from unicron.detect.hang import HangDetector

    det = HangDetector(k=3.0, floor_s=2.0, warmup_steps=3, first_step_timeout_s=300.0)
    det.start(0.0, [0, 1])
    assert det.check(250.0) is None  # nobody stepped yet: the first-step allowance (300 s)
    det = HangDetector(k=3.0, floor_s=2.0, warmup_steps=3, first_step_timeout_s=300.0)
    det.start(0.0, [0, 1])
    for rank in (0, 1):
        det.observe(rank, 1, 4.0)  # start-up took 4 s
        det.observe(rank, 2, 4.1)
    threshold, warmup = det.threshold_s()
    assert warmup and threshold == 12.0  # 3 x 4 s
    assert det.check(4.1 + 11.9) is None
    verdict = det.check(4.1 + 12.1)
    assert verdict is not None and verdict.warmup


def test_busy_job_gets_the_longer_threshold_never_below_the_idle_one() -> None:
    det = HangDetector(k=3.0, floor_s=2.0, warmup_steps=1, first_step_timeout_s=60.0, busy_k=5.0, busy_floor_s=10.0)
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 20, dt=0.5, t0=1.0)
    assert det.threshold_s(busy=False) == (2.0, False)
    assert det.threshold_s(busy=True) == (10.0, False)
    # An evaluation on rank 0 keeps the job busy: no hang at the idle threshold.
    assert det.check(now + 5.0, busy=True) is None
    idle = det.check(now + 5.0, busy=False)
    assert idle is not None and not idle.busy and "idle" in idle.message
    late = det.check(now + 10.5, busy=True)
    assert late is not None and late.busy and "busy" in late.message
    # Raising the idle floor above the busy one still buys time while busy.
    det2 = HangDetector(k=3.0, floor_s=60.0, warmup_steps=1, first_step_timeout_s=300.0, busy_k=5.0, busy_floor_s=10.0)
    det2.start(0.0, [0])
    run_steps(det2, [0], 10, dt=0.5, t0=1.0)
    assert det2.threshold_s(busy=True) == (60.0, False)
    assert det2.overdue_s(10.0) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        HangDetector(busy_k=0.0)


def test_work_between_steps_counts_as_progress() -> None:
    det = HangDetector(k=3.0, floor_s=1.5, warmup_steps=1, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 20, dt=0.1, t0=1.0)
    # Rank 0 evaluates for a minute (working), every rank idle in between: no hang while it
    # works, and the idle clock runs from the last work seen.
    assert det.check(now + 60.0, working_at=now + 59.0) is None
    verdict = det.check(now + 61.0, working_at=now + 59.0)
    assert verdict is not None and verdict.stalled_s == pytest.approx(2.0)
    assert det.check(now + 61.0) is not None and det.check(now + 61.0).stalled_s == pytest.approx(61.0)


def test_idle_threshold_runs_from_the_end_of_a_busy_phase() -> None:
    det = HangDetector(k=3.0, floor_s=1.5, warmup_steps=1, first_step_timeout_s=60.0, busy_k=5.0, busy_floor_s=30.0)
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 20, dt=0.1, t0=1.0)
    # 20 s in a native call (busy), then idle waiting for a moment: not a 20 s stall.
    assert det.check(now + 20.0, busy=True, busy_at=now + 20.0) is None
    assert det.check(now + 21.0, busy=False, busy_at=now + 20.0) is None
    verdict = det.check(now + 21.6, busy=False, busy_at=now + 20.0)
    assert verdict is not None and verdict.stalled_s == pytest.approx(1.6)
    # While busy, the busy threshold runs from the last step, not from the busy phase itself.
    assert det.check(now + 30.5, busy=True, busy_at=now + 30.5) is not None


@given(
    intervals=st.lists(st.floats(min_value=0.001, max_value=5.0), min_size=0, max_size=20),
    ranks=st.integers(min_value=1, max_value=3),
    later=st.floats(min_value=0.0, max_value=20.0),
    busy=st.booleans(),
    mark=st.one_of(st.none(), st.floats(min_value=0.0, max_value=20.0)),
)
def test_no_verdict_comes_before_quiet_s_runs_out(intervals: list[float], ranks: int, later: float, busy: bool,
                                                  mark: float | None) -> None:
    """The agent sleeps ``quiet_s`` between events: no verdict may fall inside that sleep,
    whatever the job is doing (busy, working) when it is checked."""
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=30.0)
    det.start(0.0, range(ranks))
    now = 0.0
    for step, dt in enumerate(intervals, start=1):
        now += dt
        for r in range(ranks):
            det.observe(r, step, now)
    at = now + later
    quiet = det.quiet_s(at)
    assert quiet >= 0.0
    check_at = at + quiet * 0.999
    working_at = None if mark is None else min(check_at, mark)
    if quiet > 0:  # (0: a verdict is due already)
        assert det.check(check_at, busy=busy, working_at=working_at, busy_at=working_at) is None
    if not busy and mark is None:
        # and once it has run out, an idle job is hung
        assert det.check(at + quiet + 1e-6) is not None


def test_quiet_s_with_no_ranks_is_unbounded_and_falls_to_zero_when_overdue() -> None:
    det = HangDetector(k=3.0, floor_s=2.0, warmup_steps=1, first_step_timeout_s=60.0)
    assert det.quiet_s(5.0) == float("inf")
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 20, dt=0.1, t0=1.0)
    assert det.quiet_s(now) == pytest.approx(2.0)
    assert det.quiet_s(now + 1.5) == pytest.approx(0.5)
    assert det.quiet_s(now + 9.0) == 0.0


def test_a_pause_of_the_observer_does_not_count_as_the_ranks_silence() -> None:
    """The agent was stopped (SIGSTOP, a VM pause) for 10 s: its ranks' silence in that time
    is not theirs to answer for; the hang clock runs on from where it was."""
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=60.0)
    det.start(0.0, [0, 1])
    now = run_steps(det, [0, 1], 30, dt=1.0, t0=5.0)
    det.paused(10.0)
    assert det.check(now + 10.0 + 2.9) is None
    verdict = det.check(now + 10.0 + 3.1)
    assert verdict is not None and verdict.stalled_s == pytest.approx(3.1)
    # Acceptance 24A F5: the verdict says the whole silence, and what of it was not counted.
    assert "no step completed for 13.10s by rank(s) 0, 1, 10.0s of it not counted" in verdict.message
    det.observe(0, 31, now + 13.5)  # the next step's interval is what ran, not the pause
    assert det.stats.iter_times(0)[-1] == pytest.approx(3.5)
    det.observe(1, 31, now + 13.5)
    assert "not counted" not in det.check(now + 13.5 + 3.1).message  # a step since: nothing excused


def test_a_pause_never_moves_a_clock_past_now() -> None:
    """The coordinator was silent for 30 s while the ranks stepped (a standalone coordinator
    restarting): excusing that silence must not put their clocks in the future, where a hang
    would go unseen for as long and every step before it would be a 0 s sample."""
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=60.0)
    det.start(0.0, [0])
    now = run_steps(det, [0], 30, dt=1.0, t0=5.0)
    det.paused(30.0, now)
    assert det.check(now + 3.1) is not None
    det.observe(0, 31, now + 1.0)
    assert det.stats.iter_times(0)[-1] == pytest.approx(1.0)


def test_ranks_stepping_unevenly_is_progress_lockstep_one_ahead_is_not() -> None:
    from unicron.detect.hang import uneven_progress

    # A lockstep job whose rank 1 is stuck: rank 0 finished the step in flight, one ahead.
    assert not uneven_progress({0: (21, 10.0), 1: (20, 9.9)}, 10.5, 1.0)
    # Rank 0 trains on alone (an uneven end): two or more ahead and stepping now.
    assert uneven_progress({0: (25, 10.4), 1: (20, 9.0)}, 10.5, 1.0)
    assert not uneven_progress({0: (25, 8.0), 1: (20, 7.0)}, 10.5, 1.0)  # ... but it stopped too
    assert not uneven_progress({0: (25, 10.4)}, 10.5, 1.0)  # one rank alone: nothing to compare
    assert uneven_progress({"a": (5, 3.0), "b": (3, 1.0), "c": (4, 2.0)}, 3.5, 1.0)


def test_startup_is_the_time_to_the_last_ranks_first_step() -> None:
    stats = StepStats()
    stats.start(100.0, [0, 1])
    stats.observe(0, 1, 102.0)
    assert stats.startup_s() is None  # rank 1 has not stepped yet
    stats.observe(1, 1, 104.5)
    stats.observe(0, 2, 105.0)
    assert stats.startup_s() == pytest.approx(4.5)


def test_a_restarted_attempt_whose_ranks_all_wait_is_hung_after_k_times_the_earlier_startup() -> None:
    # The first attempt took 8 s to every rank's first step; the restart's idle ranks get 5 x 8 s.
    det = HangDetector(k=3.0, floor_s=1.0, first_step_timeout_s=300.0, startup_hint_s=8.0)
    det.start(0.0, [0, 1])
    det.observe(0, 20, 3.0)  # rank 0 restored and stepped; rank 1 is stuck in its restore
    assert det.threshold_s() == (40.0, True)
    assert det.check(39.0) is None
    verdict = det.check(41.0)
    assert verdict is not None and verdict.warmup and verdict.stalled_ranks == (1,)
    # A rank that burns CPU (compiling, say) keeps the whole first-step allowance.
    assert det.threshold_s(busy=True) == (300.0, True)
    assert det.check(41.0, busy=True) is None
    # A quick start-up still gets the floor; the user's --first-step-timeout stays the ceiling.
    quick = HangDetector(first_step_timeout_s=300.0, startup_hint_s=0.5)
    quick.start(0.0, [0])
    assert quick.threshold_s() == (30.0, True)
    short = HangDetector(first_step_timeout_s=12.0, startup_hint_s=8.0)
    short.start(0.0, [0])
    assert short.threshold_s() == (12.0, True)
    # Without an earlier start-up (a first attempt), the first-step timeout applies as before.
    first = HangDetector(first_step_timeout_s=300.0)
    first.start(0.0, [0])
    assert first.threshold_s() == (300.0, True)


def test_a_rank_that_never_steps_is_let_go_once_another_is_past_warm_up() -> None:
    # Ranks 0 and 1 learn; rank 2 (an actor, an evaluator) never builds an optimizer. Without
    # letting it go the job would stay under the first-step allowance for good.
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=300.0)
    det.start(0.0, [0, 1, 2])
    expects = {0: True, 1: True, 2: False}
    gone: list[int] = []
    now = 0.0
    for s in range(1, 8):
        now += 0.1
        for r in (0, 1):
            det.observe(r, s, now)
            gone += det.forget_stepless(r, expects.__getitem__)
    assert gone == [2] and det.stats.ranks == [0, 1]
    assert det.threshold_s() == (pytest.approx(0.5), False)  # the idle floor, not 300 s
    verdict = det.check(now + 0.6)
    assert verdict is not None and not verdict.warmup and verdict.stalled_ranks == (0, 1)
    assert det.forget_stepless(0, expects.__getitem__) == []  # once an attempt
    det.expect(2, now + 0.6)  # it built an optimizer after all: its first step is awaited
    assert det.stats.ranks == [0, 1, 2] and det.threshold_s()[1]


def test_a_rank_that_said_it_will_step_is_not_let_go() -> None:
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=300.0)
    det.start(0.0, [0, 1])
    for s in range(1, 6):
        det.observe(0, s, s * 0.1)
        assert det.forget_stepless(0, lambda r: True) == []
    assert det.stats.ranks == [0, 1] and det.threshold_s() == (300.0, True)


def test_a_verdict_of_one_node_among_several_says_the_ranks_are_that_nodes() -> None:
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=0, first_step_timeout_s=10.0)
    det.start(0.0, [2, 3])
    verdict = det.check(11.0)
    assert verdict is not None and "by rank(s) 2, 3 (" in verdict.message
    from dataclasses import replace
    assert "by this node's rank(s) 2, 3 (" in replace(verdict, one_node_of_several=True).message


def _burst(det: HangDetector, ranks: list[int], now: float, step: int, steps: int,
           checked: bool = False) -> tuple[float, int]:
    """``steps`` steps of every rank 1 ms apart from ``now`` (``checked``: no verdict after each)."""
    for _ in range(steps):
        now += 0.001
        step += 1
        for r in ranks:
            det.observe(r, step, now)
        assert not checked or det.check(now) is None
    return now, step


def test_a_loop_that_steps_in_bursts_is_judged_by_its_recurring_wait_not_its_median() -> None:
    # An RL loop: 1.8 s idle waiting for rollouts, then four optimizer steps in quick
    # succession. The median gap is ~1 ms; its iteration is the wait (acceptance 29A F1: called
    # hung 1.5 s into every wait, every attempt, until the budget was spent).
    # The first wait after the first burst has nothing to be told from a hang by but the start-up:
    # warm-up must span two bursts (--hang-warmup-steps 9 here; docs/failures.md says so).
    det = HangDetector(k=3.0, floor_s=1.5, warmup_steps=9, first_step_timeout_s=300.0)
    det.start(0.0, [0, 1])
    now, step = 0.0, 0
    for _ in range(12):
        now, step = _burst(det, [0, 1], now + 1.8, step, 4, checked=True)
        wait_end = now + 1.8
        while now < wait_end:  # the next wait, checked as the agent does
            now += 0.1
            assert det.check(now) is None, f"false hang {now - (wait_end - 1.8):.1f}s into a wait"
        now = wait_end - 1.8
    threshold, warmup = det.threshold_s()
    assert not warmup and 3.5 <= threshold <= 3.7  # 2 x the recurring 1.8 s wait
    verdict = det.check(now + threshold + 0.01)
    assert verdict is not None and "2 x the recurring gap 1.80" in verdict.message
    assert "--hang-floor 1.5s" in verdict.message


def test_a_one_off_long_gap_does_not_raise_the_threshold() -> None:
    det = HangDetector(k=3.0, floor_s=0.5, warmup_steps=2, first_step_timeout_s=60.0)
    det.start(0.0, [0])
    now = run_steps(det, [0], 20, 0.1, 0.0)
    now += 30.0  # an evaluation whose work counted as progress
    det.observe(0, 21, now)
    now = run_steps(det, [0], 5, 0.1, now, step0=21)
    assert det.threshold_s() == (0.5, False)


def test_a_verdict_names_the_flag_that_raises_its_threshold() -> None:
    det = HangDetector(k=3.0, floor_s=1.5, warmup_steps=2, first_step_timeout_s=60.0, busy_floor_s=10.0)
    det.start(0.0, [0])
    now = run_steps(det, [0], 10, 0.05, 0.0)
    idle = det.check(now + 1.6)
    assert idle is not None and "allowed 1.50s while idle" in idle.message and "--hang-floor 1.5s" in idle.message
    busy = det.check(now + 10.1, busy=True)
    assert busy is not None and "while busy" in busy.message and "--hang-busy-floor 10s" in busy.message
    early = HangDetector(k=3.0, floor_s=1.5, warmup_steps=3, first_step_timeout_s=60.0)
    early.start(0.0, [0])
    early.observe(0, 1, 0.2)
    verdict = early.check(1.8)
    assert verdict is not None and verdict.warmup and "at least --hang-floor 1.5s" in verdict.message
    assert early.check(59.0, busy=False) is not None
    first = HangDetector(k=3.0, floor_s=1.5, warmup_steps=3, first_step_timeout_s=60.0)
    first.start(0.0, [0])
    verdict = first.check(60.5)
    assert verdict is not None and "--first-step-timeout 60s" in verdict.message


@given(st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=2, max_size=2500))
def test_the_recurring_gap_is_the_second_longest_of_the_window_however_gaps_come_and_go(gaps: list[float]) -> None:
    import heapq

    from unicron.detect.stepstats import GAP_WINDOW

    stats = StepStats(window=50, skip_first=1)
    stats.start(0.0, [0])
    now = 0.0
    stats.observe(0, 1, now)
    for step, gap in enumerate(gaps, start=2):
        now += gap
        stats.observe(0, step, now)
    window = [b - a for a, b in zip(_times(gaps), _times(gaps)[1:], strict=False)][-GAP_WINDOW:]
    assert stats.recurring_gap() == pytest.approx(heapq.nlargest(2, window)[1] if len(window) >= 2 else None)


def _times(gaps: list[float]) -> list[float]:
    times, now = [0.0], 0.0
    for gap in gaps:
        now += gap
        times.append(now)
    return times


def test_waits_between_bursts_longer_than_the_median_window_stay_the_loops_rhythm() -> None:
    # 60 steps a burst: with the median's 50-interval window the waits fell out of it and each
    # one was a hang again (acceptance 30A F3).
    det = HangDetector(k=3.0, floor_s=1.5, warmup_steps=3, first_step_timeout_s=300.0)
    det.start(0.0, [0])
    now, step = 0.0, 0
    for _ in range(5):
        now, step = _burst(det, [0], now + 2.0, step, 60)
    assert det.threshold_s() == (pytest.approx(4.0, abs=0.01), False)
