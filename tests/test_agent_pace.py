"""The agent loop's pace (``unicron.agent.pace``): when it wakes with nothing happening."""

from __future__ import annotations

from unicron.agent.pace import CHORES_EVERY_S, IDLE_WAKE_S, MESSAGES_EVERY_S, LoopPace


def _pace() -> LoopPace:
    return LoopPace(monitor_interval_s=0.1, heartbeat_interval_s=0.5)


def test_imminent_work_ticks_at_the_fast_pace_capped_by_the_monitor_interval() -> None:
    assert _pace().wait_s(100.0, last_heartbeat=100.0, imminent=True) == 0.05
    slow = LoopPace(monitor_interval_s=0.01, heartbeat_interval_s=0.5)
    assert slow.wait_s(100.0, last_heartbeat=100.0, imminent=True) == 0.01


def test_between_events_it_sleeps_until_the_first_thing_due() -> None:
    pace = _pace()
    pace.watched(100.0, 5.0, exits_wake=True)  # the hang clock needs no look for 5 s: capped
    assert pace.next_watch == 100.0 + IDLE_WAKE_S
    assert pace.chores_due(100.0) and not pace.chores_due(100.2)
    # heartbeat due at 100.3, chores at 100.5, watch at 100.5
    assert abs(pace.wait_s(100.1, last_heartbeat=99.8, imminent=False) - 0.2) < 1e-9
    # overdue: no sleep at all, never a negative one
    assert pace.wait_s(101.0, last_heartbeat=99.0, imminent=False) == 0.0


def test_the_workers_are_looked_at_when_their_hang_clock_needs_it() -> None:
    pace = _pace()
    pace.watched(10.0, 0.2, exits_wake=True)
    assert not pace.watch_due(10.1) and pace.watch_due(10.2)
    pace.watched(10.0, 0.0, exits_wake=True)  # sampling: every tick, not busier
    assert pace.next_watch == 10.05
    pace.watched(10.0, 5.0, exits_wake=False)  # no pidfds: only a look sees an exit
    assert pace.next_watch == 10.05
    pace.watched(10.0, None, exits_wake=True)  # nothing to watch
    assert pace.next_watch == 10.0 + IDLE_WAKE_S
    pace.watch_now()
    assert pace.watch_due(0.0)


def test_chores_come_once_per_period() -> None:
    pace = _pace()
    due = [t / 10 for t in range(30) if pace.chores_due(t / 10)]
    assert due == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert CHORES_EVERY_S == 0.5


def test_worker_messages_wake_the_loop_at_most_once_a_batch() -> None:
    pace = _pace()
    pace.watched(100.0, 5.0, exits_wake=True)
    pace.chores_due(100.0)
    assert pace.messages_wake(100.0)
    pace.messages_read(100.0, 0)  # a wake-up for something else, no messages: nothing changes
    assert pace.messages_wake(100.0)
    pace.messages_read(100.0, 3)
    assert not pace.messages_wake(100.0 + MESSAGES_EVERY_S / 2)
    # asleep without the channel: wakes when the batch is due, to read what came meanwhile
    assert abs(pace.wait_s(100.0, last_heartbeat=100.0, imminent=False) - MESSAGES_EVERY_S) < 1e-9
    assert pace.messages_wake(100.0 + MESSAGES_EVERY_S)
    # once due, the channel is polled again and the loop sleeps until the next thing due
    assert abs(pace.wait_s(100.0 + MESSAGES_EVERY_S, last_heartbeat=100.0, imminent=False)
               - (0.5 - MESSAGES_EVERY_S)) < 1e-9


def test_a_ring_ends_the_quiet_period_at_once() -> None:
    pace = _pace()
    pace.messages_read(100.0, 5)
    assert not pace.messages_wake(100.01)
    pace.messages_now()
    assert pace.messages_wake(100.01)
