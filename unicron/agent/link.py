"""What an agent knows of its coordinator: when it last heard from it, the job's activity it
last reported, and whether the job still shows signs of life (pure: the clock is passed in).

Every heartbeat is answered, so the coordinator's silence means something; but only the time
this agent was listening counts (``paused``: the agent itself was stopped, or busy stopping its
workers, and the answers wait in its socket), and steps of this node's ranks are signs of life
too: a step needs every rank's collective, the coordinator's node's included, so while steps
come the job lives even when the coordinator's launcher is stopped.

How long a silence means the coordinator is gone depends on its connection: closed (its process
died: its host's kernel closed the socket; or never made), ``lost_after_s``. Still open, either
the coordinator's process lives but does not answer (stopped, swapping, its node's launcher
frozen with the ranks on it: this node's ranks do not step either), and its host still accepts
TCP connections on the coordinator's port (``unicron.agent.hostprobe`` tries once a second);
then ``OPEN_FACTOR`` times longer, so that a node frozen for tens of seconds costs the job
nothing, as under torchrun, whose agents never give up on a silent store while their workers
run. Or nothing answers: a partition, or the host frozen whole or gone; no kernel closes the
connection then, and ``lost_after_s`` applies, as for a closed one. A node whose workers all
finished waits only ``lost_after_s`` for the job's end to be confirmed: it did its part.
"""

from __future__ import annotations

from unicron.detect.activity import Activity

MIN_LOST_AFTER_S = 15.0
OPEN_FACTOR = 4  # silence allowed while the coordinator's process lives, in units of lost_after_s
ANSWER_FRESH_S = 5.0  # a connect to the coordinator's host this recent says the host is up (one a second)


class CoordinatorLink:
    def __init__(self, now: float, *, heartbeat_interval_s: float, heartbeat_timeout_s: float,
                 hosts_ranks: bool = True) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        # Whether the coordinator's node runs ranks of the job (embedded in a launcher) rather
        # than standing alone: only then may its silence be what this node's ranks wait for.
        self.hosts_ranks = hosts_ranks
        # Generous: silence this long means the coordinator is gone (or cut off from us); a busy
        # coordinator on a loaded host must not look lost.
        self.lost_after_s = max(5 * heartbeat_timeout_s, MIN_LOST_AFTER_S)
        self.heard_at = now
        self.level = Activity.IDLE
        self.level_at: float | None = None  # when the job's activity was last heard
        self.open = False  # a ZMTP session with the coordinator is up (the socket's monitor says)
        self.excused_s = 0.0  # silence excused from the ranks' hang clocks this attempt (see unheard)
        self.host_answered_at: float | None = None  # the coordinator's host last accepted a TCP connect
        self.deaf_since: float | None = None  # the coordinator said it hears no other node (see told_deaf)

    def connection(self, up: bool) -> None:
        """The socket's monitor saw the session to the coordinator come up, or close."""
        self.open = up

    def host_answered(self, at: float | None) -> None:
        """When the coordinator's host last accepted a connect on its port (``hostprobe``)."""
        self.host_answered_at = at

    def probing(self, now: float) -> bool:
        """Whether the coordinator's host is worth probing: silent (two answers missed) over an
        open connection."""
        return self.open and now - self.heard_at > 2 * self.heartbeat_interval_s

    def lives_unheard(self, now: float) -> bool:
        """Silent, but its connection is open and its host accepts connections: the
        coordinator's process lives (stopped, swapping)."""
        return (self.open and self.host_answered_at is not None
                and now - self.host_answered_at <= ANSWER_FRESH_S)

    def limit_s(self, now: float, done: bool = False) -> float:
        """The silence that means the coordinator is gone, given what is known of it at ``now``
        (``done``: this node's workers all finished)."""
        return self.lost_after_s * (OPEN_FACTOR if not done and self.lives_unheard(now) else 1)

    def heard(self, now: float, level: Activity | None = None) -> float:
        """A message came (an ``ack`` carries the job's ``level``). Returns the silence that
        just ended to excuse from the ranks' hang clocks (see ``unheard``)."""
        ended = 0.0
        if self._silent_unheard(now) and self.deaf_since is None:  # while deaf, told_deaf excuses it
            ended = min(now - self.heard_at - 2 * self.heartbeat_interval_s, self.limit_s(now) - self.excused_s)
            self.excused_s += ended
        self.heard_at = now
        if level is not None:
            self.level, self.level_at = level, now
        return ended

    def new_attempt(self) -> None:
        self.excused_s = 0.0
        self.deaf_since = None  # the next ack says whether it still is: none of it is this attempt's

    def told_deaf(self, now: float, deaf: bool) -> float:
        """An ack says whether the coordinator hears none of the nodes it could hear over the
        network (``unicron.coord.hearing``: its own link is likelier cut). This node's ranks
        then wait on ranks of nodes it cannot hear either, so, as while the coordinator itself
        is unheard, no hang is called here, and the time is taken off the ranks' hang clocks
        when it hears them again: returned then (within the same per-attempt limit)."""
        if deaf:
            if self.deaf_since is None:
                self.deaf_since = now
            return 0.0
        if self.deaf_since is None:
            return 0.0
        ended = max(min(now - self.deaf_since, self.limit_s(now) - self.excused_s), 0.0)
        self.excused_s += ended
        self.deaf_since = None
        return ended

    def unheard(self, now: float) -> bool:
        """The coordinator, embedded in a node that runs ranks, missed two answers: it, or its
        node, is stopped, cut off, or gone. Its node's ranks may be what this node's ranks wait
        for, so no hang is called here meanwhile (a verdict could not be acted on before it
        answers anyway), and the silence does not count against the ranks' hang clocks when it
        answers again. At most ``limit_s`` of silence is excused per attempt, so that a
        coordinator that answers only now and then cannot hide a hang for ever."""
        if self.deaf_since is not None:  # see told_deaf
            return now - self.deaf_since < self.limit_s(now) - self.excused_s
        return self._silent_unheard(now)

    def _silent_unheard(self, now: float) -> bool:
        return (self.hosts_ranks and self.excused_s < self.limit_s(now)
                and now - self.heard_at > 2 * self.heartbeat_interval_s)

    def paused(self, gap_s: float) -> None:
        """This agent did not listen for ``gap_s``: nobody's silence in that time counts."""
        self.heard_at += gap_s
        if self.deaf_since is not None:
            self.deaf_since += gap_s
        if self.level_at is not None:
            self.level_at += gap_s

    def job_level(self, now: float) -> Activity:
        """The job's activity as last heard; at least BUSY after two missed answers (the
        coordinator's own rule for a silent node: shorter than the idle hang floor, so a node
        frozen with the coordinator on it is not taken for a hang of the ranks waiting on it)."""
        if self.level_at is None or now - self.level_at > 2 * self.heartbeat_interval_s:
            return max(self.level, Activity.BUSY)
        return self.level

    def silent_s(self, now: float, stepped_at: float | None = None) -> float:
        """How long the job has shown no sign of life: no word, and no step since ``stepped_at``."""
        return now - max(self.heard_at, stepped_at if stepped_at is not None else self.heard_at)

    def lost(self, now: float, stepped_at: float | None = None, *, done: bool = False) -> bool:
        return self.silent_s(now, stepped_at) > self.limit_s(now, done)
