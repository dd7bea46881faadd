"""A commit's step as the mesh carries it (pure): ``unicron.State.commit`` takes the steps
completed over the whole run, whatever number type the script counts them in, and refuses
at once what no restore could give back."""

from __future__ import annotations

import operator

from unicron.proto.messages import INT_LIMIT
from unicron.worker.errors import StateError

MAX_STEP = INT_LIMIT - 1  # what the mesh's messages carry (27C F2: commit(10**20) broke the stop)


def step_number(step: object) -> int:
    """``commit``'s step as an int (a 0-d tensor or numpy integer too); anything else, a step
    that is not whole, or one past 64 bits, is the script's mistake, said at once."""
    try:
        value = operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        value = None
        if isinstance(step, float) and step.is_integer():
            value = int(step)
        elif hasattr(step, "item") and not isinstance(step, (str, bytes)):  # a 0-d tensor
            try:
                item = step.item()
            except (RuntimeError, ValueError, TypeError):
                item = None
            if isinstance(item, int) or (isinstance(item, float) and item.is_integer()):
                value = int(item)
    # Not a truth value (numpy's and torch's either), nor a tensor or array of one element (28A)
    boolean = isinstance(step, bool) or "bool" in str(getattr(step, "dtype", ""))
    if value is None or boolean or getattr(step, "ndim", 0) != 0:
        raise StateError(f"unicron.State.commit({step!r}): the step must be a whole number (the steps completed)")
    if not 0 <= value <= MAX_STEP:
        raise StateError(f"unicron.State.commit({value}): the step must be between 0 and 2**63 - 1")
    return value
