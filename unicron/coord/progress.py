"""Each rank's steps in one attempt, and the two questions every heartbeat asks of them (pure):

- does a rank train on ahead of another (``unicron.detect.hang.uneven_progress``: the job is
  WORKING, not hung, while it does);
- has every rank stepped since a silent node was heard again (``Attempt.recovering``).

Asked of every rank at every heartbeat, each would cost O(world size), and a job of thousands of
nodes O(nodes^2) a second. So both are kept as steps come: the slowest step in a heap of step
values, the ranks that stepped recently in a monotonic queue, the ranks not heard stepping
since the silence in a set. Each step a heartbeat brings costs O(log ranks); each question,
O(1) amortised. The answers are the same as the scans' (``tests/test_coord_scale.py``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from unicron.detect.hang import LEAD_STEPS


class RankProgress:
    def __init__(self) -> None:
        self.steps: dict[int, tuple[int, float]] = {}  # rank -> (steps completed, when first heard)
        self._at_step: dict[int, int] = {}  # step -> how many ranks are at it
        self._lows: list[int] = []  # a heap of step values; one no rank is at any more is dropped when met
        # (when, step) of ranks' steps: times rising, steps falling. A step that a later, higher
        # one follows can never be the highest recent one again, and is dropped as it comes.
        self._recent: deque[tuple[float, int]] = deque()
        self._asked = (-math.inf, 0.0)  # the latest ``uneven`` (now, within_s): older entries were dropped
        self._resort = False  # a step came with an earlier time than the last (a clock stepped back)
        self._since: float | None = None  # when a silent node was heard again
        self._waiting: set[int] = set()  # ranks (of range(world size)) not heard stepping after it
        self._world_size = 0

    def note(self, rank: int, step: int, now: float) -> None:
        """Rank ``rank`` completed ``step`` steps (heard at ``now``); a count not above the
        last one (or below 0) is ignored."""
        old = self.steps.get(rank)
        if step <= (old[0] if old is not None else -1):
            return
        self.steps[rank] = (step, now)
        if old is not None:
            self._at_step[old[0]] -= 1
            if not self._at_step[old[0]]:
                del self._at_step[old[0]]
        if step not in self._at_step:
            self._at_step[step] = 0
            heapq.heappush(self._lows, step)
            if len(self._lows) > 2 * len(self._at_step) + 64:  # steps no rank is at: bounded memory
                self._lows = list(self._at_step)
                heapq.heapify(self._lows)
        self._at_step[step] += 1
        if self._recent and now < self._recent[-1][0]:
            self._resort = True
        else:
            while self._recent and self._recent[-1][1] <= step:
                self._recent.pop()
            self._recent.append((now, step))
        if self._since is not None and 0 <= rank < self._world_size:
            (self._waiting.add if now <= self._since else self._waiting.discard)(rank)

    def slowest(self) -> int | None:
        lows = self._lows
        while lows and lows[0] not in self._at_step:
            heapq.heappop(lows)
        return lows[0] if lows else None

    def uneven(self, now: float, within_s: float) -> bool:
        """``uneven_progress(self.steps, now, within_s)``, without looking at every rank."""
        slowest = self.slowest()
        if slowest is None or len(self.steps) < 2:
            return False
        # Asked about an earlier moment (a clock stepped back) or another window: what was
        # dropped may count again, so the queue is built anew.
        if self._resort or now < self._asked[0] or within_s != self._asked[1]:
            self._rebuild()
        self._asked = (now, within_s)
        recent = self._recent
        while recent and now - recent[0][0] > within_s:  # the same test as uneven_progress's
            recent.popleft()
        return bool(recent) and recent[0][1] >= slowest + LEAD_STEPS

    def heard_again(self, since: float, world_size: int) -> None:
        """A silent node was heard again at ``since``: until every rank of ``range(world_size)``
        steps after it, the attempt is recovering."""
        self._since, self._world_size = since, world_size
        self._waiting = {r for r in range(world_size) if self.steps.get(r, (0, since))[1] <= since}

    def recovering(self) -> bool:
        return self._since is not None and bool(self._waiting)

    def _rebuild(self) -> None:
        self._resort = False
        self._recent.clear()
        for at, step in sorted((at, step) for step, at in self.steps.values()):
            while self._recent and self._recent[-1][1] <= step:
                self._recent.pop()
            self._recent.append((at, step))
