"""Did the coordinator hear anyone? A coordinator judges nodes by their silence, but when it
hears *no* node of *any* job it serves, its own link is the likelier fault (its NIC, its switch
port, a firewall change on its host) than every node failing in the same second: the silence
is its own, and judging it would end or restart every job while their ranks train on (the
agents themselves go on through a coordinator they cannot reach, ``unicron.agent.link``).

So, as for a stall of its own process (``unicron.detect.stall``), silence heard from everyone
at once, whose hosts do not answer a connect either (``unicron.coord.hearing`` probes them), is
not counted against anyone, past a short allowance and up to a cap:

- the allowance, ``timeout - 2 x interval`` of a job's heartbeat settings (2 s by default):
  longer than the gap between two heartbeats of the job's nodes, so a healthy job never trips
  it; shorter than ``timeout - interval``, so a node that heartbeated just before the cut is
  not lost first. A job whose timeout is under three intervals has no room for it;
- only with two nodes or more across the coordinator's jobs: one node's silence is its own;
- up to ``DEAF_CAP_S``: if every node really died at once with its host (a whole cluster's
  power), they are lost that much later (launchers killed together leave hosts that answer). What counts as heard is a node's message: not a ``unicron status`` request, which may
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
        # When a probe of the silent nodes' hosts that got no answer started (None: none did):
        # silence is excused only on this evidence, from a probe started after the last word.
        self.unanswered_at: float | None = None
        self._excused: dict[str, float] = {}  # job -> silence already excused in this spell
        self._over: set[str] = set()  # jobs whose spell ended with nobody heard (the cap, no nodes left)

    def heard(self, now: float) -> dict[str, float]:
        """Something came from the network at ``now``: the spell of deafness, if any, ends.
        Returns the silence each job excused in it (empty: there was none). News older than
        what is known (a probe that started before the last word) changes nothing."""
        if now < self.heard_at:
            return {}
        excused, self._excused = self._excused, {}
        self._over.clear()
        self.heard_at = now
        return excused

    def unanswered(self, started: float) -> None:
        """A probe that started at ``started`` got no answer from any silent node's host."""
        if started >= self.heard_at and (self.unanswered_at is None or started > self.unanswered_at):
            self.unanswered_at = started

    def cut_seen(self) -> bool:
        """Whether a probe started after the last word got no answer: the link was cut during
        this silence (asked before ``heard`` ends it)."""
        return self.unanswered_at is not None and self.unanswered_at >= self.heard_at

    def paused(self, gap_s: float) -> None:
        """The coordinator's process did not run for ``gap_s``: that silence is excused already
        (``unicron.detect.stall``), not to be excused twice."""
        self.heard_at += max(gap_s, 0.0)

    def excuse(self, job: str, now: float, *, interval_s: float, timeout_s: float, nodes: int) -> float:
        """How much more silence ``job`` should not count now (its deadlines move on by it), for
        a coordinator that serves ``nodes`` nodes it could hear over the network. Nothing
        without a probe started after the last word that got no answer; nothing past the cap,
        nor once fewer than two such nodes are left (the spell is then over for the job)."""
        after = allowance_s(interval_s, timeout_s)
        if after is None or nodes < 2 or not self.cut_seen() or job in self._over:
            if job in self._excused:
                self._over.add(job)
            return 0.0
        total = min(max(now - self.heard_at - after, 0.0), self.cap_s)
        more = total - self._excused.get(job, 0.0)
        if total > 0:
            self._excused[job] = total
        if total >= self.cap_s:
            self._over.add(job)
        return max(more, 0.0)

    def deaf_s(self, now: float) -> float:
        """How long nobody has been heard."""
        return max(now - self.heard_at, 0.0)

    def spell_started(self, job: str) -> bool:
        """Whether ``job`` excused silence in the current spell (it has been told of it)."""
        return job in self._excused

    def deaf_for(self, job: str) -> bool:
        """Whether ``job`` excuses silence now (its spell started and is not over)."""
        return job in self._excused and job not in self._over
