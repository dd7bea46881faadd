"""When the agent's loop wakes with nothing happening (pure: times passed in).

Exits (pidfds), messages and signals wake the loop at once; between them it sleeps until the
next thing falls due, since every wake-up takes CPU from the ranks on its cores: a heartbeat,
a look at the workers (the hang clock, ``WorkerGroup.next_check_s``), or the chores (refilling
the zygote, reaping orphans). It ticks at ``tick_s`` only while something is imminent: before it
is a member, while an attempt waits for the zygote, or on a kernel without pidfds (where only a
look sees an exit).

Worker messages are the exception: each rank sends one per step, which at a few steps per
second per rank on a full node would be most of the agent's wake-ups. Once some were read,
the channel is left out of the poll for ``MESSAGES_EVERY_S`` and read in one batch after it
(and on any other wake-up). Step times come from the messages' own stamps; a worker's exit
wakes the loop through its pidfd; a message that cannot wait (an exception) rings a doorbell
(``unicron.worker.channel``), which ends the quiet period at once (``messages_now``).
"""

from __future__ import annotations

TICK_S = 0.05  # the fastest pace (and the slowest --monitor-interval takes effect up to)
IDLE_WAKE_S = 0.5  # the longest sleep between events
CHORES_EVERY_S = 0.5
MESSAGES_EVERY_S = 0.1  # worker messages wake the loop at most this often


class LoopPace:
    def __init__(self, *, monitor_interval_s: float, heartbeat_interval_s: float) -> None:
        self.tick_s = min(monitor_interval_s, TICK_S)
        self.heartbeat_interval_s = heartbeat_interval_s
        self.next_watch = 0.0  # when the workers are next looked at without an event
        self.next_chores = 0.0
        self.messages_quiet_until = 0.0  # worker messages do not wake the loop before this

    def watch_due(self, now: float) -> bool:
        return now >= self.next_watch

    def watch_now(self) -> None:
        """New workers: look at them on the next turn."""
        self.next_watch = 0.0

    def watched(self, now: float, next_check_s: float | None, *, exits_wake: bool) -> None:
        """The workers were looked at; ``next_check_s``: how long their hang clock needs no
        look (None: no workers to watch, or they finished)."""
        if next_check_s is None:
            wait = IDLE_WAKE_S
        elif not exits_wake:
            wait = self.tick_s
        else:
            wait = min(max(next_check_s, self.tick_s), IDLE_WAKE_S)
        self.next_watch = now + wait

    def chores_due(self, now: float) -> bool:
        """True once every ``CHORES_EVERY_S``; the next ones are counted from ``now``."""
        if now < self.next_chores:
            return False
        self.next_chores = now + CHORES_EVERY_S
        return True

    def messages_wake(self, now: float) -> bool:
        """Whether worker messages may wake the loop now (see the module docstring)."""
        return now >= self.messages_quiet_until

    def messages_now(self) -> None:
        """A worker rang the doorbell (an urgent message): read the channel as soon as it arrives."""
        self.messages_quiet_until = 0.0

    def messages_read(self, now: float, count: int) -> None:
        """``count`` worker messages were read at ``now``: the next ones wait for a batch."""
        if count:
            self.messages_quiet_until = now + MESSAGES_EVERY_S

    def wait_s(self, now: float, *, last_heartbeat: float, imminent: bool) -> float:
        """How long the loop may sleep when nothing arrives."""
        if imminent:
            return self.tick_s
        due = min(self.next_watch, self.next_chores, last_heartbeat + self.heartbeat_interval_s)
        if not self.messages_wake(now):  # then read the messages that came meanwhile
            due = min(due, self.messages_quiet_until)
        return min(max(due - now, 0.0), IDLE_WAKE_S)
