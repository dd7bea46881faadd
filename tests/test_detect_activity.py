"""The activity evidence (idle, busy or working?), driven by fake counters and reports."""

from __future__ import annotations

import pytest

from unicron.detect.activity import Activity, ActivityTracker, BusyRule, Usage, level_between


def test_level_between_by_io_then_cpu_and_counters_that_go_back() -> None:
    rule = BusyRule(cpu_cores=0.2, io_bytes_per_s=1000.0)
    assert level_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.5, 0), rule) is Activity.BUSY  # half a core
    assert level_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.1, 0), rule) is Activity.IDLE  # a tenth
    assert level_between(Usage(0.0, 1.0, 0), Usage(2.0, 1.0, 5000), rule) is Activity.WORKING  # 2500 B/s
    assert level_between(Usage(0.0, 1.0, 0), Usage(1.0, 3.0, 5000), rule) is Activity.WORKING, "I/O wins"
    # A descendant exited: the tree's counters shrink; that is not negative work.
    assert level_between(Usage(0.0, 9.0, 9000), Usage(1.0, 1.0, 10), rule) is Activity.IDLE
    assert level_between(Usage(1.0, 0.0, 0), Usage(1.0, 5.0, 0), rule) is Activity.IDLE, "no time passed"
    with pytest.raises(ValueError):
        BusyRule(window_s=0.1, period_s=0.25)
    with pytest.raises(ValueError):
        BusyRule(cpu_cores=0.0)


def test_helper_processes_that_compute_are_work_the_worker_itself_spinning_is_busy() -> None:
    rule = BusyRule(cpu_cores=0.2, io_bytes_per_s=1000.0)
    # A data loader's workers (half a core between them) while the worker waits for batches.
    assert level_between(Usage(0.0, 1.0, 0, 0.5), Usage(1.0, 1.55, 0, 1.0), rule) is Activity.WORKING
    # The worker spins (a CUDA synchronisation, a long native call); its helpers are quiet.
    assert level_between(Usage(0.0, 1.0, 0, 0.5), Usage(1.0, 2.0, 0, 0.55), rule) is Activity.BUSY
    # Helpers that exited took their time to the worker as reaped time: no negative work either.
    assert level_between(Usage(0.0, 5.0, 0, 4.0), Usage(1.0, 1.05, 0, 0.0), rule) is Activity.IDLE


def test_cpu_waited_for_counts_only_for_a_thread_runnable_at_both_ends() -> None:
    """On an oversubscribed host a computing rank receives 0.1 of a core and waits 0.9 on a run
    queue (acceptance 19B F1: it was called idle, and hung at 1.5 s). A waiting rank's threads
    sleep, whatever their brief wake-ups waited: not runnable at the samples, nothing counts."""
    rule = BusyRule(cpu_cores=0.2)
    computing = (Usage(0.0, 1.0, 0, runq_s=3.0, runnable=True), Usage(1.0, 1.1, 0, runq_s=3.9, runnable=True))
    assert level_between(*computing, rule) is Activity.BUSY
    woke_once = (Usage(0.0, 1.0, 0, runq_s=3.0, runnable=False), Usage(1.0, 1.1, 0, runq_s=3.9, runnable=True))
    assert level_between(*woke_once, rule) is Activity.IDLE
    # A data loader's workers that want the CPU while the worker waits for their batches.
    helpers = (Usage(0.0, 1.0, 0, 0.5, runq_s=1.0, helper_runq_s=1.0, helper_runnable=True),
               Usage(1.0, 1.1, 0, 0.6, runq_s=1.5, helper_runq_s=1.5, helper_runnable=True))
    assert level_between(*helpers, rule) is Activity.WORKING
    # The helpers' wait is theirs: it does not make the worker itself busy.
    assert level_between(Usage(0.0, 1.0, 0, 0.5, runq_s=1.0, helper_runq_s=1.0, runnable=True),
                         Usage(1.0, 1.1, 0, 0.6, runq_s=1.5, helper_runq_s=1.5, runnable=True), rule) is Activity.IDLE


def test_a_blocked_console_and_a_draining_send_queue_are_work() -> None:
    rule = BusyRule()
    # Blocked writing stdout into a full pipe at both ends of the window (acceptance 19B F2).
    assert level_between(Usage(0.0, 1.0, 0, output_wait=True), Usage(1.0, 1.0, 0, output_wait=True),
                         rule) is Activity.WORKING
    assert level_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.0, 0, output_wait=True), rule) is Activity.IDLE
    # Its data leaving over a slow link (acceptance 18C F4): 2 KB/s is enough, 500 B/s is not.
    assert level_between(Usage(0.0, 1.0, 0, net_drained=10), Usage(1.0, 1.0, 0, net_drained=2010),
                         rule) is Activity.WORKING
    assert level_between(Usage(0.0, 1.0, 0, net_drained=10), Usage(1.0, 1.0, 0, net_drained=510),
                         rule) is Activity.IDLE


def test_wire_names() -> None:
    assert [Activity.parse(n) for n in ("idle", "busy", "working", "WORKING")] == [
        Activity.IDLE, Activity.BUSY, Activity.WORKING, Activity.WORKING]
    assert Activity.parse("sleepy") is Activity.IDLE and Activity.parse(None) is Activity.IDLE
    assert Activity.IDLE < Activity.BUSY < Activity.WORKING


def test_tracker_needs_evidence_and_judges_the_last_window() -> None:
    tracker = ActivityTracker(BusyRule(cpu_cores=0.2, window_s=1.0, period_s=0.25))
    assert tracker.due(0.0) and tracker.level(0.0) is None
    tracker.add(0.0, {0: Usage(0.0, 0.0, 0), 1: Usage(0.0, 0.0, 0)})
    assert tracker.level(0.0) is None, "one sample is no evidence"
    assert not tracker.due(0.1) and tracker.due(0.25)
    # Rank 1 computes for 2 s with its Python still (a long native call), then stops.
    t = 0.0
    for _ in range(8):
        t += 0.25
        tracker.add(t, {0: Usage(t, 0.0, 0), 1: Usage(t, t, 0)})
    assert tracker.levels(t) == {0: Activity.IDLE, 1: Activity.BUSY} and tracker.level(t) is Activity.BUSY
    spent = t
    for _ in range(6):
        t += 0.25
        tracker.add(t, {0: Usage(t, 0.0, 0), 1: Usage(t, spent, 0)})
    assert tracker.level(t) is Activity.IDLE, "idle over the last window"
    # Rank 0's worker says its Python moves: working, for one window after the report.
    tracker.moved(0, t)
    assert tracker.level(t + 0.5) is Activity.WORKING
    assert tracker.level(t + 1.5) is Activity.IDLE
    # A rank whose process is gone drops out; reset forgets everything.
    tracker.add(t + 0.25, {0: Usage(t + 0.25, 0.0, 0), 1: None})
    assert set(tracker.levels(t + 0.25)) == {0}
    tracker.moved(1, t)
    tracker.reset()
    assert tracker.level(t) is None and tracker.due(t)
    # A moved report alone is evidence.
    tracker.moved(2, 50.0)
    assert tracker.level(50.2) is Activity.WORKING


def test_waiting_for_a_data_loader_is_busy_while_it_is_reported() -> None:
    tracker = ActivityTracker(BusyRule(window_s=1.0, period_s=0.25))
    tracker.waits_for_data(1, 10.0)
    assert tracker.levels(10.5) == {1: Activity.BUSY}  # not a peer's hang: the longer threshold
    assert tracker.levels(11.5) == {}  # no report for a window: no evidence
    tracker.waits_for_data(1, 11.4)
    tracker.moved(1, 11.4)
    assert tracker.levels(11.5) == {1: Activity.WORKING}  # Python moving counts more
    tracker.reset()
    assert tracker.levels(11.5) == {}
