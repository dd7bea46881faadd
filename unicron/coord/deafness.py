"""Did the coordinator hear anyone? A coordinator judges nodes by their silence, but when it
hears *no* node of *any* job it serves, its own link is the likelier fault (its NIC, its switch
port, a firewall change on its host) than every node failing in the same second: the silence
is its own, and judging it would end or restart every job while their ranks train on (the
agents themselves go on through a coordinator they cannot reach, ``unicron.agent.link``).

So, as for a stall of its own process (``unicron.detect.stall``), silence heard from everyone
at once is not counted against anyone, past a short allowance and up to a cap:

- the allowance, ``timeout - 2 x interval`` of a job's heartbeat settings (2 s by default):
  longer than the gap between two heartbeats of the job's nodes, so a healthy job never trips
  it; shorter than ``timeout - interval``, so a node that heartbeated just before the cut is
  not lost first. A job whose timeout is under three intervals has no room for it;
- only with two nodes or more across the coordinator's jobs: one node's silence is its own;
- up to ``DEAF_CAP_S``: if every node really died at once (a whole cluster's power, every
  launcher of a standalone coordinator's only job killed together), they are lost that much
  later. What counts as heard is a node's message: not a ``unicron status`` request, which may
  come from the coordinator's own host while its network is cut, nor a connection's opening or
  closing, which the same request makes.

Pure: times are passed in.
"""

from __future__ import annotations

DEAF_CAP_S = 60.0


def allowance_s(interval_s: float, timeout_s: float) -> float | None:
    """How long nobody may be heard before a job stops counting the silence (None: never)."""
    after = timeout_s - 2 * interval_s
    return after if after > interval_s else None


class DeafWatch:
    """The coordinator's hearing, across every job it serves."""

    def __init__(self, now: float, cap_s: float = DEAF_CAP_S) -> None:
        self.heard_at = now
        self.cap_s = cap_s
        self._excused: dict[str, float] = {}  # job -> silence already excused in this spell

    def heard(self, now: float) -> dict[str, float]:
        """Something came from the network: the spell of deafness, if any, ends. Returns the
        silence each job excused in it (empty: there was none)."""
        excused, self._excused = self._excused, {}
        self.heard_at = max(self.heard_at, now)
        return excused

    def paused(self, gap_s: float) -> None:
        """The coordinator's process did not run for ``gap_s``: that silence is excused already
        (``unicron.detect.stall``), not to be excused twice."""
        self.heard_at += max(gap_s, 0.0)

    def excuse(self, job: str, now: float, *, interval_s: float, timeout_s: float, nodes: int) -> float:
        """How much more silence ``job`` should not count now (its deadlines move on by it), for
        a coordinator that serves ``nodes`` active nodes in all."""
        after = allowance_s(interval_s, timeout_s)
        if after is None or nodes < 2:
            return 0.0
        total = min(max(now - self.heard_at - after, 0.0), self.cap_s)
        more = total - self._excused.get(job, 0.0)
        if total > 0:
            self._excused[job] = total
        return max(more, 0.0)

    def deaf_s(self, now: float) -> float:
        """How long nobody has been heard."""
        return max(now - self.heard_at, 0.0)

    def spell_started(self, job: str) -> bool:
        """Whether ``job`` excuses silence in the current spell (it has been told of it)."""
        return job in self._excused
