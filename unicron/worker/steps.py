"""Which optimizer steps end an iteration, and ``unicron.step()`` (pure: no I/O)."""

from __future__ import annotations

import weakref
from typing import Any


class StepCounter:
    """Completed-step bookkeeping (pure: no I/O)."""

    def __init__(self) -> None:
        self.completed = 0
        self.explicit = False  # set by the first unicron.step(): optimizer steps stop counting
        self._first_optimizer: weakref.ref[Any] | None = None
        self._other: tuple[int, int] | None = None  # (id, steps) of another optimizer since the counted one's last
        self._replaced: tuple[weakref.ref[Any], int] | None = None  # the optimizer taken over from, and the count then
        self._turns: set[int] = set()  # ids of optimizers known to take turns: neither replaces the other
        # After a take-over that turned out to be turns, the counts up to here were already
        # announced (during the iteration that misled us): they are not announced a second time.
        self._quiet_until = 0

    def on_optimizer_step(self, optimizer: object) -> int | None:
        """New completed count if this optimizer step ends an iteration, else None.

        The optimizer that steps first counts; others in the same loop (a GAN's, a critic's)
        step between its steps. Another one that steps twice with no step of the counted one in
        between has replaced it (a second phase of fine-tuning with a new optimizer over every
        parameter, the first one still referenced): it counts from then on. Unless the first one
        steps again: then the two take turns (a critic stepped n times per generator step), the
        first counts again, and the count goes back to where it was when it was taken over; the
        counts announced meanwhile are not announced again (a step number names one iteration).
        One seen taking turns with the first (it stepped, then the first did) never replaces it:
        a generator that sometimes steps twice in an iteration still counts once (acceptance
        33A F5: its second step was taken for a take-over, announced, then announced again)."""
        if self.explicit:
            return None
        first = self._first_optimizer() if self._first_optimizer is not None else None
        if first is None:  # no optimizer yet, or the first one was garbage collected
            self._first_optimizer = weakref.ref(optimizer)
        elif first is not optimizer:
            replaced = self._replaced
            if replaced is not None and replaced[0]() is optimizer:  # it was not replaced: they take turns
                self._turns.update((id(first), id(optimizer)))
                self._quiet_until = max(self._quiet_until, self.completed)
                self._first_optimizer, self.completed, self._replaced = replaced[0], replaced[1], None
            else:
                seen = self._other[1] if self._other is not None and self._other[0] == id(optimizer) else 0
                if seen + 1 < 2 or {id(first), id(optimizer)} <= self._turns:
                    self._other = (id(optimizer), seen + 1)
                    return None
                self._replaced = (weakref.ref(first), self.completed)
                self._first_optimizer = weakref.ref(optimizer)
        elif self._other is not None:  # another stepped since this one's last: they take turns
            self._turns.update((id(first), self._other[0]))
        self._other = None
        self.completed += 1
        return self.completed if self.completed > self._quiet_until else None

    def rebase(self, completed: int) -> None:
        """Set the count without a boundary (a restore): it is announced from there on."""
        self.completed = int(completed)
        self._quiet_until = 0

    def on_explicit_step(self, completed: int | None) -> int | None:
        """New completed count, or None when there is no new boundary to announce.

        The first ``unicron.step()`` of a loop that also steps an optimizer comes right after
        the hook counted that iteration: it takes the boundary over instead of counting twice.
        """
        takes_over = not self.explicit and self._first_optimizer is not None and completed is None
        self.explicit = True
        if takes_over:
            return None
        self.completed = self.completed + 1 if completed is None else int(completed)
        return self.completed
