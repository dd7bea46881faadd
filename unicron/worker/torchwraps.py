"""Wrappers around torch's own functions that tell the agent of a rank's phases (a part of the
worker's hooks, ``unicron.worker.hooks``, which installs them as the modules are imported):
``Optimizer.__init__`` (the rank will report steps) and ``destroy_process_group`` /
``init_process_group`` of ``distributed_c10d`` (the rank is past its collectives, or back).

Split from ``unicron.worker.hooks``, which holds the worker's runtime (its step count, its
exception and exit reports): how torch's functions are wrapped, once and keeping their names
and re-exports, is one concern of its own; what the wrappers report goes through the hooks'
callbacks.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from unicron.worker import channel

_closed = False  # said ``closed``: the default process group was destroyed


def announce_optimizers(optimizer_module: ModuleType, built: Callable[[Any], object]) -> None:
    """Wrap ``Optimizer.__init__`` (once) to call ``built(optimizer)`` for every optimizer this
    rank builds (the hooks send ``optim`` at the first: it will report steps, so until it does
    it is before its first step (start-up), however long that takes, and never a script of
    unknown progress)."""
    cls = getattr(optimizer_module, "Optimizer", None)
    if cls is None or getattr(cls.__init__, "_unicron", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        built(self)

    __init__._unicron = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def announce_destroy(c10d_module: ModuleType, *, past_end: Callable[[], object],
                     raised: Callable[[BaseException], object]) -> None:
    """Wrap ``destroy_process_group`` (once) to send ``closed`` as the default group goes,
    and ``init_process_group`` to send ``opened`` before a new one is made after that (the
    script goes on with collectives: no longer past them). Hooked as soon as
    ``distributed_c10d`` is executed, before ``torch.distributed`` re-exports them; where that
    already happened (torch imported before the hooks), the re-exports too. ``past_end()``: the
    default group went with no exception on its way out; ``raised(err)``: with ``err``, to be
    reported as pending."""
    destroy = getattr(c10d_module, "destroy_process_group", None)
    init = getattr(c10d_module, "init_process_group", None)
    if destroy is None or init is None or getattr(destroy, "_unicron", False):
        return

    @functools.wraps(destroy)
    def destroy_process_group(group: Any = None, *args: Any, **kwargs: Any) -> Any:
        global _closed
        members = getattr(c10d_module, "GroupMember", None)
        default = group is None or (members is not None and group is getattr(members, "WORLD", None))
        if default:  # said first: the peers' collectives fail on it before it returns
            _closed = True
            # In a ``finally`` on an exception's way out (``try: train() finally:
            # destroy_process_group()``): not a clean end. The exception is reported now: the
            # cleanup after this may outlast the stop that its peers' failures on the destroyed
            # group bring (acceptance 25A F1, 26A F2: it was never said).
            err = sys.exc_info()[1]
            raising = err is not None and not (isinstance(err, SystemExit) and err.code in (0, None))
            # But inside an ``except`` that caught it and cleans up (an early stop: acceptance 27A
            # F1) the same is true: so it is sent as pending, which the rank's exit decides.
            channel.get().emit("closed", **({"raising": True} if raising else {}))
            if not raising:
                past_end()
            elif err is not None:
                raised(err)
        try:
            return destroy(group, *args, **kwargs)
        except BaseException:
            if default:  # not destroyed after all
                _closed = False
                channel.get().emit("opened")
            raise

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        global _closed
        if _closed:
            _closed = False
            channel.get().emit("opened")
        # Joining: a rank that fails in here (a peer it cannot reach) is still starting up.
        channel.get().emit("init")
        return init(*args, **kwargs)

    package = sys.modules.get("torch.distributed")
    for name, original, wrapper in (("destroy_process_group", destroy, destroy_process_group),
                                    ("init_process_group", init, init_process_group)):
        wrapper._unicron = True  # type: ignore[attr-defined]
        setattr(c10d_module, name, wrapper)
        if package is not None and getattr(package, name, None) is original:
            setattr(package, name, wrapper)
