"""Which optimizer steps end an iteration, and ``unicron.step()`` (pure: no I/O)."""

from __future__ import annotations

import weakref
from typing import Any

# The longest run of steps of one optimizer, with no step of the counted one in between, that
# may still be part of turn-taking before it means the counted one stopped stepping: a WGAN
# critic's usual 5 steps per generator step, whichever steps first. Once two take turns the
# bound grows to twice the longest run they were seen making.
TURN_RUN = 5
NONE = range(0)


def _parameter_ids(optimizer: object) -> set[int]:
    groups = getattr(optimizer, "param_groups", None) or ()
    return {id(p) for group in groups if isinstance(group, dict) for p in group.get("params", ())}


class StepCounter:
    """Completed-step bookkeeping (pure: no I/O).

    The optimizer that steps first is the counted one: its step ends an iteration. While it
    steps alone, every step counts. Others that step between two of its steps take turns with
    it (a GAN's, a critic's, a head's): from then on an iteration is one round, and a step of
    the counted one counts only if another stepped since its last one (a generator that steps
    twice in one iteration counts once, whichever of the pair steps first).

    Another optimizer replaces the counted one (two-phase fine-tuning) at once when it updates a
    parameter the counted one does (a new optimizer over the same model), else when it runs more
    than TURN_RUN steps (more than twice the longest run seen, for one that took turns) with no
    step of the counted one: each of those steps counts then, at once (a critic stepped n times
    after its generator is told from a replacement only by the generator's next step, and a
    count is never taken back). Likewise the counted one's own run that long means its partners
    stopped: its uncounted steps of the run count, and every step counts again.
    """

    def __init__(self) -> None:
        self.completed = 0
        self.explicit = False  # set by the first unicron.step(): optimizer steps stop counting
        self._counted: weakref.ref[Any] | None = None
        self._partners: weakref.WeakSet[Any] = weakref.WeakSet()  # seen taking turns with the counted one
        self._since: weakref.WeakSet[Any] = weakref.WeakSet()  # stepped since the counted one's last step
        self._disjoint: weakref.WeakSet[Any] = weakref.WeakSet()  # share no parameter with the counted one
        self._last: weakref.ref[Any] | None = None  # the optimizer that stepped last, ...
        self._run = 0  # ... and how many times in a row
        self._longest = 0  # the longest run seen while two take turns

    def on_optimizer_step(self, optimizer: object) -> range:
        """The completed counts this optimizer step announces, in order (mostly none or one)."""
        if self.explicit:
            return NONE
        last = self._last() if self._last is not None else None
        if last is optimizer:
            self._run += 1
        else:
            if last is not None and self._partners:
                self._longest = max(self._longest, self._run)
            self._last, self._run = weakref.ref(optimizer), 1
        counted = self._counted() if self._counted is not None else None
        if counted is None:  # no optimizer yet, or the counted one was garbage collected
            return self._take_over(optimizer, 1)
        if counted is optimizer:
            if self._since:  # another stepped since its last step: a round ended
                self._partners.update(self._since)
                self._since.clear()
                return self._count(1)
            if not self._partners:
                return self._count(1)
            if self._run > self._limit():  # its partners stopped: the run's other steps count too
                self._partners.clear()
                return self._count(self._run - 1)
            return NONE
        self._since.add(optimizer)
        if optimizer in self._partners:
            # Its first step of the run was the last round's own; each later one ended an iteration.
            return self._take_over(optimizer, self._run - 1) if self._run > self._limit() else NONE
        if optimizer not in self._disjoint:
            if _parameter_ids(optimizer) & _parameter_ids(counted):
                return self._take_over(optimizer, self._run)
            self._disjoint.add(optimizer)
        return self._take_over(optimizer, self._run) if self._run > TURN_RUN else NONE

    def _limit(self) -> int:
        return max(TURN_RUN, 2 * self._longest)

    def _take_over(self, optimizer: object, steps: int) -> range:
        self._counted = weakref.ref(optimizer)
        self._partners, self._since, self._disjoint = weakref.WeakSet(), weakref.WeakSet(), weakref.WeakSet()
        self._longest = 0
        return self._count(steps)

    def _count(self, steps: int) -> range:
        first = self.completed + 1
        self.completed += steps
        return range(first, self.completed + 1)

    def rebase(self, completed: int) -> None:
        """Set the count without a boundary (a restore): it is announced from there on."""
        self.completed = int(completed)

    def on_explicit_step(self, completed: int | None) -> int | None:
        """New completed count, or None when there is no new boundary to announce.

        The first ``unicron.step()`` of a loop that also steps an optimizer comes right after
        the hook counted that iteration: it takes the boundary over instead of counting twice.
        """
        takes_over = not self.explicit and self._counted is not None and completed is None
        self.explicit = True
        if takes_over:
            return None
        self.completed = self.completed + 1 if completed is None else int(completed)
        return self.completed
