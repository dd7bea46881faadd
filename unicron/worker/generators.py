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
from typing import Any

import torch


class _TorchGenerator:
    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.gen.get_state()}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.gen.set_state(saved["state"])


class _PythonRandom:
    def __init__(self, gen: random.Random) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.gen.getstate()
        return {"version": version, "internal": list(internal), "gauss": gauss}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.gen.setstate((saved["version"], tuple(saved["internal"]), saved["gauss"]))


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


class _NumpyGenerator:
    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": _plain(self.gen.bit_generator.state)}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.gen.bit_generator.state = _numpy(saved["state"])


class _NumpyRandomState:
    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": _plain(self.gen.get_state(legacy=False))}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.gen.set_state(_numpy(saved["state"]))


def as_stateful(obj: Any) -> Any | None:
    """``obj`` wrapped with ``state_dict()`` / ``load_state_dict()`` if it is a random generator
    of torch, numpy (``Generator`` of any bit generator, the legacy ``RandomState``) or python;
    None otherwise. ``random.SystemRandom`` has no state: None."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return _PythonRandom(obj)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return _NumpyGenerator(obj)
    if numpy is not None and isinstance(obj, numpy.random.RandomState):
        return _NumpyRandomState(obj)
    return None
