"""Errors of the worker API: misuses of ``unicron.State`` that a restart would only repeat.

Each message starts with ``unicron.State``; the classifier stops the job on them at any step
(rule ``user-state-error`` in ``docs/failures.md``) rather than restarting into the same error.
Both are also the built-in type a caller would expect (``ValueError``, ``TypeError``).
"""

from __future__ import annotations


class StateError(ValueError):
    """``unicron.State`` used in a way it cannot honour (a step that goes back, two States
    writing one rank's snapshots, a snapshot of other objects than this State holds)."""


class SnapshotTypeError(StateError, TypeError):
    """A value ``unicron.State`` cannot snapshot and give back with its exact type."""
