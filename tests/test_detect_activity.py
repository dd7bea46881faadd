"""The activity evidence (is any rank using CPU or doing I/O?), driven by fake counters."""

from __future__ import annotations

import pytest

from unicron.detect.activity import ActivityTracker, BusyRule, Usage, busy_between


def test_busy_between_by_cpu_or_io_and_counters_that_go_back() -> None:
    rule = BusyRule(cpu_cores=0.2, io_bytes_per_s=1000.0)
    assert busy_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.5, 0), rule)  # half a core
    assert not busy_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.1, 0), rule)  # a tenth of a core
    assert busy_between(Usage(0.0, 1.0, 0), Usage(2.0, 1.0, 5000), rule)  # 2500 B/s
    # A descendant exited: the tree's counters shrink; that is not negative work.
    assert not busy_between(Usage(0.0, 9.0, 9000), Usage(1.0, 1.0, 10), rule)
    assert not busy_between(Usage(1.0, 0.0, 0), Usage(1.0, 5.0, 0), rule), "no time passed"
    with pytest.raises(ValueError):
        BusyRule(window_s=0.1, period_s=0.25)
    with pytest.raises(ValueError):
        BusyRule(cpu_cores=0.0)


def test_tracker_needs_two_samples_and_judges_the_last_window() -> None:
    tracker = ActivityTracker(BusyRule(cpu_cores=0.2, window_s=1.0, period_s=0.25))
    assert tracker.due(0.0) and tracker.busy() is None
    tracker.add(0.0, {0: Usage(0.0, 0.0, 0), 1: Usage(0.0, 0.0, 0)})
    assert tracker.busy() is None, "one sample is no evidence"
    assert not tracker.due(0.1) and tracker.due(0.25)
    # Rank 1 computes for 2 s (an evaluation), then stops (a hang begins); rank 0 idles.
    t = 0.0
    for _ in range(8):
        t += 0.25
        tracker.add(t, {0: Usage(t, 0.0, 0), 1: Usage(t, t, 0)})
    assert tracker.busy_ranks() == [1] and tracker.busy()
    cpu0 = t
    for _ in range(6):
        t += 0.25
        tracker.add(t, {0: Usage(t, 0.0, 0), 1: Usage(t, cpu0, 0)})
    assert tracker.busy_ranks() == [] and tracker.busy() is False, "idle over the last window"
    # A rank whose process is gone drops out; reset forgets everything.
    tracker.add(t + 0.25, {0: Usage(t + 0.25, 0.0, 0), 1: None})
    assert tracker.busy() is False
    tracker.reset()
    assert tracker.busy() is None and tracker.due(t)
