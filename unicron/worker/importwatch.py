"""Run a hook on a module right after it is first executed, without importing it early.

The worker's hooks must patch ``torch.optim.optimizer``, DDP and ``distributed_c10d`` before
the script uses them, yet a worker that never imports torch must not pay for importing it. A
meta-path finder sees the import, lets the real finder find the module, and wraps its loader's
``exec_module`` so the hook runs once the module's body has run. Modules already imported (a
warm interpreter imported torch before the script) are hooked at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

Hook = Callable[[ModuleType], None]


class _Watcher(importlib.abc.MetaPathFinder):
    def __init__(self, hooks: Mapping[str, Hook]) -> None:
        self.hooks = dict(hooks)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                self._hook_after_exec(spec.loader, fullname)
                return spec
        return None

    def _hook_after_exec(self, loader: Any, name: str) -> None:
        exec_module = loader.exec_module

        def exec_and_hook(module: ModuleType) -> None:
            exec_module(module)
            if all(n in sys.modules for n in self.hooks):  # nothing left to wait for
                self.uninstall()
            self.hooks[name](module)

        loader.exec_module = exec_and_hook

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def after_import(hooks: Mapping[str, Hook]) -> None:
    """Call ``hooks[name](module)`` once each module named is executed (now, if it already was)."""
    waiting = {}
    for name, hook in hooks.items():
        module = sys.modules.get(name)
        if module is not None:
            hook(module)
        else:
            waiting[name] = hook
    if waiting:
        sys.meta_path.insert(0, _Watcher(waiting))
