"""The process-global random generators a training step draws from (python ``random``, numpy's
global RNG when numpy is loaded, torch's CPU and initialised CUDA generators), captured as
values ``snapcodec`` encodes and restored from them: part of every ``unicron.State`` snapshot."""

from __future__ import annotations

import array
import random
import sys
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may draw from, as values ``snapcodec`` encodes."""
    version, internal, gauss = random.getstate()  # 625 ints: one tensor, not 625 JSON numbers
    # 625 ints through an array: half the time of torch.tensor(list of ints); the tensor keeps it alive
    as_tensor = torch.frombuffer(array.array("q", internal), dtype=torch.int64)
    rng: dict[str, Any] = {"python": {"version": version, "state": as_tensor,
                                      "gauss": gauss},
                           "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        n = rng["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)
