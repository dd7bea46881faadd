"""When each active node was last heard from, kept ordered by time (pure).

A job of thousands of nodes sends the coordinator thousands of heartbeats a second. Each one
asks whether a node of the job is silent (the job's activity), and the loop after it asks
which nodes are past the heartbeat timeout and when the first deadline falls: a scan of every
node would make each heartbeat cost O(nodes), the job O(nodes^2) a second. A binary min-heap
that knows where each node sits answers from its oldest entries: O(log n) per heartbeat, and
a query costs about the number of nodes it returns (none while every node is heard).
"""

from __future__ import annotations

from collections.abc import Collection


class LastHeard:
    """Key -> time, with the keys heard longest ago found without a scan."""

    def __init__(self) -> None:
        self._times: list[float] = []  # a min-heap on time; _keys[i] is the key at _times[i]
        self._keys: list[str] = []
        self._pos: dict[str, int] = {}  # key -> its index in the heap

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def get(self, key: str) -> float | None:
        i = self._pos.get(key)
        return None if i is None else self._times[i]

    def set(self, key: str, at: float) -> None:
        i = self._pos.get(key)
        if i is None:
            self._times.append(at)
            self._keys.append(key)
            self._pos[key] = len(self._keys) - 1
            self._up(len(self._keys) - 1)
            return
        old, self._times[i] = self._times[i], at
        if at < old:  # a clock that stepped back
            self._up(i)
        elif at > old:
            self._down(i)

    def discard(self, key: str) -> None:
        i = self._pos.pop(key, None)
        if i is None:
            return
        last = len(self._keys) - 1
        at, moved = self._times.pop(), self._keys.pop()
        if i == last:
            return
        self._times[i], self._keys[i] = at, moved
        self._pos[moved] = i
        self._up(i)
        self._down(self._pos[moved])

    def shift(self, gap_s: float) -> None:
        """Every time moves on by ``gap_s``; the order stays (adding one constant keeps it)."""
        self._times = [t + gap_s for t in self._times]

    # ---- queries -------------------------------------------------------------------
    def oldest(self, skip: Collection[str] = ()) -> float | None:
        """The earliest time of a key not in ``skip`` (None: none). Costs about ``len(skip)``
        when the skipped keys are the oldest ones, as the silent nodes already told of are."""
        best: float | None = None
        todo = [0] if self._keys else []
        while todo:
            i = todo.pop()
            at = self._times[i]
            if best is not None and at >= best:
                continue  # nothing below it is earlier
            if self._keys[i] not in skip:
                best = at
                continue
            todo += [c for c in (2 * i + 1, 2 * i + 2) if c < len(self._keys)]
        return best

    def silent(self, now: float, after_s: float) -> list[str]:
        """The keys whose time is more than ``after_s`` before ``now``, in no set order. Only
        the heap's entries that answer yes are visited (and the children of each)."""
        out: list[str] = []
        todo = [0] if self._keys else []
        while todo:
            i = todo.pop()
            if not now - self._times[i] > after_s:  # the same test the scan did, for the same edges
                continue
            out.append(self._keys[i])
            todo += [c for c in (2 * i + 1, 2 * i + 2) if c < len(self._keys)]
        return out

    # ---- the heap ------------------------------------------------------------------
    def _swap(self, i: int, j: int) -> None:
        t, k = self._times, self._keys
        t[i], t[j] = t[j], t[i]
        k[i], k[j] = k[j], k[i]
        self._pos[k[i]] = i
        self._pos[k[j]] = j

    def _up(self, i: int) -> None:
        while i > 0:
            parent = (i - 1) // 2
            if not self._times[i] < self._times[parent]:
                return
            self._swap(i, parent)
            i = parent

    def _down(self, i: int) -> None:
        n = len(self._keys)
        while True:
            low, left, right = i, 2 * i + 1, 2 * i + 2
            if left < n and self._times[left] < self._times[low]:
                low = left
            if right < n and self._times[right] < self._times[low]:
                low = right
            if low == i:
                return
            self._swap(i, low)
            i = low
