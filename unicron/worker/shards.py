"""A restored snapshot's DTensors (FSDP2's ``fully_shard``, tensor parallelism) made whole again.

A snapshot holds each rank's local part of a DTensor and its global shape
(``snapcodec.LocalShard``); the device mesh and the placements are not data, they are how the
live objects were built, which a restarted worker does again before ``State.restore()``. So
each shard becomes ``DTensor.from_local`` with the placements of the live counterpart: a
module's state_dict entry of the same key, or, for an optimizer's per-parameter state
(``exp_avg`` ...), the parameter it belongs to.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from unicron.worker.errors import StateError
from unicron.worker.snapcodec import LocalShard


def has_shards(tree: Any) -> bool:
    if isinstance(tree, LocalShard):
        return True
    if isinstance(tree, Mapping):
        return any(has_shards(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(has_shards(v) for v in tree)
    return False


def place_shards(name: str, saved: Any, obj: Any) -> Any:
    """``saved`` (what ``obj.state_dict()`` gave, restored) with every ``LocalShard`` a DTensor
    placed as ``obj``'s live counterpart is; ``StateError`` for one without a counterpart."""
    if not has_shards(saved):
        return saved
    if isinstance(obj, torch.optim.Optimizer) and isinstance(saved, Mapping):
        return _optimizer(name, saved, obj)
    return _like(name, saved, obj.state_dict())


def _like(where: str, saved: Any, live: Any) -> Any:
    if isinstance(saved, LocalShard):
        if not callable(getattr(live, "to_local", None)):
            raise StateError(f"unicron.State: {where} was a DTensor when snapshotted but is not one now: build "
                             "and shard the model (fully_shard, parallelize_module) before State.restore()")
        if tuple(saved.shape) != tuple(live.shape) or tuple(saved.local.shape) != tuple(live.to_local().shape):
            # Another sharding (a new mesh), or optimizer state shaped unlike its parameter
            # (a factored second moment): these placements would not be its own.
            raise StateError(f"unicron.State: {where} was a DTensor of shape {tuple(saved.shape)} (this rank's part "
                             f"{tuple(saved.local.shape)}); its live counterpart is {tuple(live.shape)} "
                             f"({tuple(live.to_local().shape)} here): it cannot be placed as that one is")
        return _from_local(saved, live)
    if isinstance(saved, dict):  # dict or OrderedDict (a module's, with its _metadata)
        out: dict[Any, Any] = type(saved)()
        for k, v in saved.items():
            out[k] = _like(f"{where}[{k!r}]", v, live.get(k) if isinstance(live, Mapping) else None)
        if hasattr(saved, "_metadata"):
            out._metadata = saved._metadata  # type: ignore[attr-defined]
        return out
    return saved


def _optimizer(name: str, saved: Mapping[str, Any], opt: torch.optim.Optimizer) -> Any:
    """Per-parameter state takes the placement of its parameter (the optimizer's state is empty
    before its first step, so it cannot be its own template)."""
    params: dict[Any, torch.Tensor] = {}
    for saved_group, group in zip(saved.get("param_groups", []), opt.param_groups, strict=False):
        params.update(zip(saved_group.get("params", []), group["params"], strict=False))
    state = {}
    for pid, per_param in saved.get("state", {}).items():
        param = params.get(pid)
        state[pid] = {k: _like(f"{name}.state[{pid!r}][{k!r}]", v, param) if isinstance(v, LocalShard) else v
                      for k, v in per_param.items()}
    return {**saved, "state": state}


def _from_local(shard: LocalShard, live: Any) -> Any:
    from torch.distributed.tensor import DTensor

    local = shard.local.to(live.to_local().device)
    stride = torch.empty(shard.shape, device="meta").stride()  # of the whole tensor, as FSDP2 makes it
    return DTensor.from_local(local, live.device_mesh, live.placements, run_check=False, shape=shard.shape,
                              stride=stride)
