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

import functools
import weakref
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
    """A commit that gradients accumulated across (a commit per micro-batch of a gradient
    accumulation): a snapshot holds no ``.grad``, so a restore from it loses what the
    micro-batches before it accumulated, and the run does not continue bit for bit (acceptance
    27A F2: nothing said so). Said once, at the optimizer step that uses such gradients.

    A commit with no optimizer step since the last one, while the State's models hold
    gradients, leaves them in flight; only an optimizer step taken on them before any
    ``zero_grad()`` proves they were accumulated across it. A step the script skipped (a
    GradScaler's on an inf, a bad batch), or an evaluation between steps, leaves gradients that
    the next ``zero_grad()`` drops (28A F4: those were warned of). The optimizers' own step
    hooks count, not the worker hooks (off with ``--no-inject``), and any ``zero_grad()`` of an
    optimizer or a module (watched on their classes: a wrapper on the instance would go into
    ``torch.save(model)`` and ``copy.deepcopy``)."""

    def __init__(self, objects: Mapping[str, Any], say: Callable[[str], None]) -> None:
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        # Weakly: the optimizers' hooks hold this, and must not keep the models (or the State,
        # through ``say``: give a function of its own) alive once the script drops them.
        self._modules = [weakref.ref(o) for o in objects.values() if isinstance(o, torch.nn.Module)]
        self._say = say
        self._steps = 0  # optimizer steps since the last commit
        self._last: int | None = None  # the step of the last commit
        self.in_flight: int | None = None  # the commit that left gradients in flight
        self.warned = not optimizers or not self._modules
        if self.warned:
            return
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self._stepping)
            optimizer.register_step_post_hook(self._stepped)
        _watch_zero_grad()
        _checks.add(self)

    def _stepping(self, *_: Any) -> None:
        if self.in_flight is not None and not self.warned:
            self.warned = True
            self._say(f"unicron: gradients were accumulated across State.commit({self.in_flight}) (no "
                      "optimizer step since the commit before it): a snapshot holds no gradients, so a restore "
                      "from it does not continue bit for bit; commit once an optimizer step is done")
        self.in_flight = None

    def _stepped(self, *_: Any) -> None:
        self._steps += 1

    def at_commit(self, step: int) -> None:
        if step == self._last:  # the same step again (its snapshot replaced): nothing accumulated since
            return
        stepped, self._steps, first, self._last = self._steps, 0, self._last is None, step
        if self.warned or stepped or first:
            return
        modules = [m for m in (ref() for ref in self._modules) if m is not None]
        if self.in_flight is None and any(_nonzero(p.grad) for m in modules for p in m.parameters()):
            self.in_flight = step  # the first commit they straddle


_checks: weakref.WeakSet[AccumulationCheck] = weakref.WeakSet()


def _watch_zero_grad() -> None:
    """Make every ``zero_grad()`` of an optimizer or a module drop the gradients in flight of
    every ``AccumulationCheck`` (once per process)."""
    for cls in (torch.optim.Optimizer, torch.nn.Module):
        original = cls.zero_grad
        if getattr(original, "_unicron", False):
            continue

        def zero_grad(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            out = _original(self, *args, **kwargs)
            for check in list(_checks):
                check.in_flight = None
            return out

        zero_grad._unicron = True  # type: ignore[attr-defined]
        functools.update_wrapper(zero_grad, original)
        cls.zero_grad = zero_grad  # type: ignore[method-assign]


def _nonzero(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    to_local = getattr(grad, "to_local", None)  # a DTensor: this rank's shard, no collective
    return bool((to_local() if callable(to_local) else grad).any())
