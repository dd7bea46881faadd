"""What the coordinator tells about peers it cannot serve (no sockets here).

A node whose secret, unicron version or job id (``--rdzv-id``) differs gets no answer (it
cannot be trusted with one) and would wait out its join timeout in silence; a node whose clock
is far off has every message dropped as stale. The user is told, once per peer and for a few
peers at most (garbage from anyone must not flood the console); a node whose clock is off is
also told the coordinator's time, at most once a second.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from unicron.textclip import clip

MAX_PEERS_WARNED = 8  # misconfigured peers named on the console; the rest are only counted
CLOCKS_KEPT = 1024  # peers remembered as told the clock (replays from many sockets: the oldest go)


def other_job(served: set[str], job: str) -> str:
    """Why an embedded coordinator refuses a join of another job signed with its secret: the
    nodes of a second job on the same endpoint waited out their join timeout, told to check
    their secret (acceptance 21B F1; torchrun's c10d store serves both)."""
    jobs = ", ".join(repr(j) for j in sorted(served))
    return (f"the coordinator at this endpoint is job {jobs}'s (embedded in its launcher), not job {job!r}'s: "
            f"one job per endpoint; give this job another --rdzv-endpoint (or the same --rdzv-id if it is that "
            f"job), or serve several jobs with `unicron coordinator`")


IDENTITY_MARK = "~"  # an agent's socket is named NODE_ID~RANDOM (unicron.agent.agent)


def peer_name(identity: bytes) -> str:
    # Agents name their socket after their node id; a socket that did not gets a binary one.
    text = identity.decode("ascii", errors="replace").split(IDENTITY_MARK, 1)[0]
    return text[:80] if text.isprintable() else f"a peer without a node id ({identity.hex()[:16]})"


class PeerWarnings:
    def __init__(self, warn: Callable[[str], None] | None, window_s: float) -> None:
        self.warn = warn  # None: nobody to tell (only counted)
        self.window_s = window_s  # how far a message's time may be off (against replays)
        self._warned: set[bytes] = set()
        self._clock_told: dict[bytes, float] = {}  # peer -> when it was last told this clock

    def clock_off(self, identity: bytes, skew_s: float, now: float) -> str | None:
        """An authentic message whose time is ``skew_s`` off this machine's: a replay, or a node
        whose clock is wrong (no NTP, a VM resumed from a suspend). The reason to send it with
        this clock (None: it was told within the last second); the user hears it once."""
        if now - self._clock_told.get(identity, -math.inf) < 1.0:
            return None
        if len(self._clock_told) >= CLOCKS_KEPT:
            self._clock_told.pop(next(iter(self._clock_told)))
        self._clock_told[identity] = now
        ahead = "ahead of" if skew_s > 0 else "behind"
        why = (f"this node's clock is {abs(skew_s):.0f} s {ahead} the coordinator's (messages may differ by "
               f"{self.window_s:g} s, against replays); it now signs with the coordinator's time: "
               "is NTP running on every node?")
        if self._first(identity):
            self._tell(f"messages from {peer_name(identity)}: {why}")
        return why

    def misconfigured(self, identity: bytes, error: str, served: set[str] | None) -> None:
        """A message dropped with ``error``: say why a node gets no answer, if it is one of
        ours set up otherwise (``served``: the job ids this coordinator serves)."""
        reason = error.split(":")[0]
        if reason not in ("unauthenticated", "version", "wrong job", "schema") or not self._first(identity):
            return
        peer = peer_name(identity)
        if reason == "schema":  # signed, so sent with the secret: said once a peer (30B F7: silent)
            self._tell(f"dropped a message from {peer} that fails its schema ({clip(error.split(': ', 1)[-1], 200)}); "
                       "more from it are dropped without a word (counted in `unicron status`)")
        elif reason == "unauthenticated":
            self._tell(f"dropped messages from {peer}: signed with another secret; is UNICRON_SECRET "
                       "(or --secret-file) the same on every node?")
        elif reason == "wrong job":
            jobs = ", ".join(repr(j) for j in sorted(served or ()))
            self._tell(f"dropped messages from {peer}: for job {error.split(': ', 1)[-1]}, but this coordinator "
                       f"serves {jobs}; is --rdzv-id the same on every node?")
        else:
            self._tell(f"dropped messages from {peer}: {error.split(': ', 1)[-1]}; run the same unicron "
                       "version on every node")

    def _first(self, identity: bytes) -> bool:
        """Whether the user is to hear of this peer (the first word of it, within the limit)."""
        if self.warn is None or identity in self._warned or len(self._warned) >= MAX_PEERS_WARNED:
            return False
        self._warned.add(identity)
        return True

    def _tell(self, text: str) -> None:
        if self.warn is not None:
            self.warn(text)
