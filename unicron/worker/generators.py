"""Random generators a script owns, as ``unicron.State`` objects.

``State`` captures the global generators itself (python ``random``, numpy's legacy global, torch
CPU and CUDA). A generator the script keeps (a ``torch.Generator`` for sampling, a
``numpy.random.default_rng()`` for augmentation, a ``random.Random``) has no ``state_dict()``;
passed to ``State`` by name, it is wrapped here so its state is snapshotted and restored with
the rest, and the run stays bit-exact.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import Any

import torch


class _GetSet:
    """``state_dict()`` / ``load_state_dict()`` over a generator's own get and set of its state."""

    def __init__(self, get: Callable[[], Any], put: Callable[[Any], Any]) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> dict[str, Any]:
        return {"state": self._get()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self._put(saved["state"])


def _plain(x: Any) -> Any:
    """A numpy bit generator's state with its arrays (MT19937's key, Philox's counter, SFC64's
    state) as lists the snapshot codec takes, their dtype and shape kept."""
    numpy = sys.modules["numpy"]
    if isinstance(x, numpy.ndarray):
        return {"numpy_dtype": x.dtype.str, "numpy_shape": list(x.shape), "numpy_data": x.ravel().tolist()}
    if isinstance(x, numpy.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _numpy(x: Any) -> Any:
    numpy = sys.modules["numpy"]
    if isinstance(x, dict) and "numpy_dtype" in x:
        return numpy.array(x["numpy_data"], dtype=x["numpy_dtype"]).reshape(x["numpy_shape"])
    if isinstance(x, dict):
        return {k: _numpy(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_numpy(v) for v in x)
    return x


def as_stateful(obj: Any) -> Any | None:
    """``obj`` wrapped with ``state_dict()`` / ``load_state_dict()`` if it is a random generator
    of torch, numpy (``Generator`` of any bit generator, the legacy ``RandomState``) or python;
    None otherwise. ``random.SystemRandom`` has no state: None."""
    if isinstance(obj, torch.Generator):
        return _GetSet(obj.get_state, obj.set_state)
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return _GetSet(obj.getstate, obj.setstate)  # a tuple of ints: the codec gives tuples back
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        bits = obj.bit_generator
        return _GetSet(lambda: _plain(bits.state), lambda state: setattr(bits, "state", _numpy(state)))
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return _GetSet(lambda: _plain(obj.get_state(legacy=False)), lambda state: obj.set_state(_numpy(state)))
    return None
