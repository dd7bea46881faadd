"""Objects a ``unicron.State`` should hold but does not: said once, at the first commit.

An LR scheduler left out of the State is the likeliest omission (README's shortest example
passes a model and an optimizer), and it is silent: after a restore the optimizer's learning
rate comes back from its snapshot, then the scheduler, starting again from its own first
step, sets the schedule's start value. The scheduler itself cannot be found from the
optimizer, but every ``LRScheduler`` leaves a mark on its optimizer's param groups
(``initial_lr``, set when it is built), so an optimizer in the State with that mark and no
scheduler of it in the State is a scheduler left out (or one the script restores itself,
which the warning allows for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch


def schedulers_left_out(objects: Mapping[str, Any]) -> list[str]:
    """Warnings, one per optimizer in ``objects`` (a State's objects by name) that a scheduler
    was built for while no scheduler of it is among ``objects``."""
    scheduled = {id(getattr(obj, "optimizer", None)) for obj in objects.values()
                 if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)}
    warnings = []
    for name, obj in objects.items():
        if not isinstance(obj, torch.optim.Optimizer) or id(obj) in scheduled:
            continue
        if any("initial_lr" in group for group in obj.param_groups):
            warnings.append(f"unicron: an LR scheduler of {name!r} is not in this unicron.State: after a restore "
                            f"it starts its schedule again (unless the script sets it itself); pass it: "
                            f"unicron.State(..., {name}={name}, scheduler=scheduler)")
    return warnings


def optimizers_left_out(objects: Mapping[str, Any], built: Iterable[Any]) -> list[str]:
    """Warnings for the optimizers in ``built`` (those the process made) that have stepped but
    are not in ``objects``, nor the inner optimizer of one that is, nor wrapped by one that is
    (``.optim``/``.optimizer``: ZeroRedundancyOptimizer, wrappers such as Lookahead)."""
    held = {id(o) for o in objects.values()}
    for obj in objects.values():
        held.update(id(inner) for attr in _INNER if (inner := getattr(obj, attr, None)) is not None)
    warnings = []
    for opt in built:
        if id(opt) in held or not getattr(opt, "state", None):
            continue  # in the State, or stateless (plain SGD): nothing a restore would lose
        if any(id(getattr(opt, attr, None)) in held for attr in _INNER):
            continue
        warnings.append(f"unicron: an optimizer ({type(opt).__name__}) that has stepped is not in this unicron.State: after a "
                        f"restore its state (moments, momentum) starts again from zero (unless the script restores "
                        f"it itself); pass it: unicron.State(..., optimizer2=it)")
    return warnings


_INNER = ("optim", "optimizer", "_optimizer")  # how a wrapper names the optimizer it wraps


def ddp_without_hooks(objects: Mapping[str, Any], tracked: Callable[[Any], bool]) -> list[str]:
    """Warnings, one per DistributedDataParallel in ``objects`` built without unicron's worker
    hooks (``--no-inject``, ``--no-python``: ``tracked`` says which were): its parameters come
    back, but not the bucket order DDP rebuilt after its first step, so the run after a restore
    is not bit for bit the one without the fault (acceptance 26B F1: said nowhere)."""
    from torch.nn.parallel import DistributedDataParallel

    return [f"unicron: the DistributedDataParallel {name!r} was built without unicron's worker hooks (--no-inject "
            f"or --no-python): a restore brings its parameters back but not its gradient buckets' order, so the "
            f"run after a restore is not bit for bit the run without the fault; run without --no-inject for that"
            for name, obj in objects.items() if isinstance(obj, DistributedDataParallel) and not tracked(obj)]


class AccumulationCheck:
    """Commits that come between optimizer steps while the State's models hold gradients (a
    commit per micro-batch of a gradient accumulation): a snapshot holds no ``.grad``, so a
    restore from one loses what was accumulated, and the run does not continue bit for bit
    (acceptance 27A F2: nothing said so). Said once. The optimizers' own step hooks count, not
    the worker hooks (off with ``--no-inject``); gradients are looked at only on a commit with
    no optimizer step since the last one, which a loop that commits once a step never makes."""

    def __init__(self, objects: Mapping[str, Any]) -> None:
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        self._modules = [o for o in objects.values() if isinstance(o, torch.nn.Module)]
        self._steps = 0
        self._last: int | None = None  # the step of the last commit
        self.warned = not optimizers or not self._modules
        for optimizer in optimizers:
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_: Any) -> None:
        self._steps += 1

    def at_commit(self, step: int) -> str | None:
        if step == self._last:  # the same step again (its snapshot replaced): nothing accumulated since
            return None
        stepped, self._steps, first, self._last = self._steps, 0, self._last is None, step
        if self.warned or stepped or first:
            return None
        if not any(_nonzero(p.grad) for m in self._modules for p in m.parameters()):
            return None
        self.warned = True
        return (f"unicron: State.commit({step}) came with no optimizer step since the last commit while the "
                "model holds gradients: gradients accumulated between optimizer steps are not in a snapshot, so "
                "a restore from it does not continue bit for bit; commit after optimizer.step()")


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    to_local = getattr(grad, "to_local", None)  # a DTensor: this rank's shard, no collective
    return bool((to_local() if callable(to_local) else grad).any())
