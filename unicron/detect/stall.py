"""Did this process run? A loop that judges others by their silence must first know that it
was listening: a SIGSTOP, a VM pause or heavy swapping stops the judge too, and the silence it
then measures is its own.

The loop marks the clock at each point of its turn; a lapse between two marks longer than the
loop allowed itself (the poll's timeout) by more than ``after_s`` is time it did not run. The
stall can fall anywhere in the turn (in the poll, while messages are handled, just before a
verdict), so the loop checks at each point where a verdict follows: a check only after the
poll misses a stall that lands while the messages of that turn are handled.

Pure: times are passed in.
"""

from __future__ import annotations

PAUSED_AFTER_S = 2.0  # a lapse this much longer than allowed: the process was stopped


class StallWatch:
    """The lapses of one loop. ``lapse`` returns how long the loop did not run since the last
    mark (beyond ``allowed_s``, the sleep it asked for), or 0 when that is under ``after_s``."""

    def __init__(self, now: float, after_s: float = PAUSED_AFTER_S) -> None:
        self.mark = now
        self.after_s = after_s

    def lapse(self, now: float, allowed_s: float = 0.0) -> float:
        late_s = now - self.mark - max(allowed_s, 0.0)
        self.mark = now
        return late_s if late_s > self.after_s else 0.0
