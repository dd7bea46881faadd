"""What an agent knows of its coordinator: when it last heard from it, the job's activity it
last reported, and whether the job still shows signs of life (pure: the clock is passed in).

Every heartbeat is answered, so the coordinator's silence means something; but only the time
this agent was listening counts (``paused``: the agent itself was stopped, or busy stopping its
workers, and the answers wait in its socket), and steps of this node's ranks are signs of life
too: a step needs every rank's collective, the coordinator's node's included, so while steps
come the job lives even when the coordinator's launcher is stopped.
"""

from __future__ import annotations

from unicron.detect.activity import Activity

MIN_LOST_AFTER_S = 15.0


class CoordinatorLink:
    def __init__(self, now: float, *, heartbeat_interval_s: float, heartbeat_timeout_s: float) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        # Generous: silence this long means the coordinator is gone (or cut off from us); a busy
        # coordinator on a loaded host must not look lost.
        self.lost_after_s = max(5 * heartbeat_timeout_s, MIN_LOST_AFTER_S)
        self.heard_at = now
        self.level = Activity.IDLE
        self.level_at: float | None = None  # when the job's activity was last heard

    def heard(self, now: float, level: Activity | None = None) -> None:
        """A message came (an ``ack`` carries the job's ``level``)."""
        self.heard_at = now
        if level is not None:
            self.level, self.level_at = level, now

    def paused(self, gap_s: float) -> None:
        """This agent did not listen for ``gap_s``: nobody's silence in that time counts."""
        self.heard_at += gap_s
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

    def lost(self, now: float, stepped_at: float | None = None) -> bool:
        return self.silent_s(now, stepped_at) > self.lost_after_s
