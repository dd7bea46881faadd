"""unicron: a drop-in torchrun that makes distributed PyTorch training heal itself.

The worker API is two names, imported lazily so ``import unicron`` stays cheap (no torch):

- ``unicron.State(model=..., optimizer=..., extra={...})``: training state that survives a
  restart bit for bit (``restore()`` / ``commit(step)``; see ``unicron.worker.state``). Its
  misuses raise ``unicron.StateError``.
- ``unicron.step(completed=None)``: marks an iteration boundary in a custom training loop
  (plain loops need nothing: optimizer steps are counted automatically).

Both work unchanged under plain ``python`` / ``torchrun``, where they do nothing visible.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["State", "StateError", "step", "__version__"]

if TYPE_CHECKING:
    from unicron.worker.errors import StateError
    from unicron.worker.state import State


def step(completed: int | None = None) -> int:
    """Mark an iteration boundary; returns the number of completed steps."""
    from unicron.worker import hooks

    return hooks.step(completed)


def __getattr__(name: str) -> Any:
    if name == "State":
        from unicron.worker.state import State

        return State
    if name == "StateError":
        from unicron.worker.errors import StateError

        return StateError
    raise AttributeError(f"module 'unicron' has no attribute {name!r}")
