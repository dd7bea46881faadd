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


class _NumpyGenerator:
    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.gen.bit_generator.state}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.gen.bit_generator.state = saved["state"]


def as_stateful(obj: Any) -> Any | None:
    """``obj`` wrapped with ``state_dict()`` / ``load_state_dict()`` if it is a random generator
    of torch, numpy or python; None otherwise."""
    if isinstance(obj, torch.Generator):
        return _TorchGenerator(obj)
    if isinstance(obj, random.Random):
        return _PythonRandom(obj)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.random.Generator):
        return _NumpyGenerator(obj)
    return None
