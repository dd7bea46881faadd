"""Variables a script sets before ``import torch``, in a worker forked with torch imported.

A warm worker (``unicron.worker.zygote``) starts with torch, torch._dynamo and the inductor
config already imported, so what torch reads while importing was read before the script ran.
A script that sets, say, ``os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"`` or
``OMP_NUM_THREADS`` above its ``import torch`` gets its value under torchrun and would silently
not under unicron. So the script's first ``import torch`` (``from torch ...``) is watched: what
the script changed since the worker started is applied where torch can take it again
(``OMP_NUM_THREADS``: ``torch.set_num_threads``; ``TORCH_LOGS``: torch's logging set up again;
``TORCH_DISTRIBUTED_DEBUG``: ``torch.distributed.set_debug_level_from_env``)
and named on stderr where it cannot (dynamo's and inductor's configs, the OpenMP/MKL runtimes),
with the fix: ``--no-warm``. Variables torch reads later (process group, CUDA allocator, the
many ``TORCHINDUCTOR_*`` read when compiling, such as ``TORCHINDUCTOR_CACHE_DIR``) are left
alone: they work either way. A ``TORCH_LOGS`` torch refuses fails the script's ``import torch``
with torch's own ValueError, as it would in a cold worker.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Mapping
from typing import Any

# Read while torch (or its OpenMP/MKL runtimes, dynamo, inductor) imports: too late once imported.
_READ_AT_IMPORT = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHELASTIC_ENABLE_FILE_TIMER",
                   "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES", "OMP_", "KMP_", "GOMP_", "MKL_",
                   "OPENBLAS_")
_REAPPLIED = ("OMP_NUM_THREADS", "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT", "TORCH_DISTRIBUTED_DEBUG")


def changed_since(start: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """Variables torch reads while importing whose value the script changed (pure)."""
    names = {n for n in (*start, *now) if n.startswith(_READ_AT_IMPORT) or n in _REAPPLIED}
    return sorted(n for n in names if start.get(n) != now.get(n))


# Where dynamo's and inductor's import-time settings live: a variable named in these modules'
# source is read when they import (a TORCHINDUCTOR_* that only compile-time code reads is not).
_CONFIG_MODULES = ("torch._inductor.config", "torch._dynamo.config", "torch._functorch.config",
                   "torch.compiler.config", "torch._inductor.runtime.hints")
_COMPILER_PREFIXES = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_")


class TorchRefused(Exception):
    """Torch's own error for a value the script set (a bad ``TORCH_LOGS``): the script's
    ``import torch`` raises it, as it would in a cold worker."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def read_by_config_modules(name: str, modules: Mapping[str, Any]) -> bool:
    """Whether an imported config module of torch's compilers names ``name`` (read at import)."""
    import inspect

    for module_name in _CONFIG_MODULES:
        module = modules.get(module_name)
        if module is None:
            continue
        try:
            if name in inspect.getsource(module):
                return True
        except (OSError, TypeError):
            return True  # no source to tell: assume it was read
    return False


def reconcile(changed: list[str], torch: Any, modules: Mapping[str, Any] | None = None) -> list[str]:
    """Apply what torch can take again; returns the names it cannot."""
    modules = sys.modules if modules is None else modules
    left = []
    for name in changed:
        if name == "OMP_NUM_THREADS":
            try:
                threads = int(os.environ.get(name, "").strip())
            except ValueError:
                threads = 0
            if threads > 0:
                torch.set_num_threads(threads)
            else:  # removed (torch's own default then) or not a number: torch chose before the script ran
                left.append(name)
        elif name.startswith("TORCH_LOGS"):
            logging_internal = modules.get("torch._logging._internal")
            if logging_internal is not None and callable(getattr(logging_internal, "_init_logs", None)):
                try:
                    logging_internal._init_logs()
                except ValueError as err:  # "Invalid log settings": what import torch says cold
                    raise TorchRefused(err) from None
            else:
                left.append(name)
        elif name == "TORCH_DISTRIBUTED_DEBUG":  # the DDP recipe: read as torch.distributed imports
            distributed = modules.get("torch.distributed")
            setter = getattr(distributed, "set_debug_level_from_env", None)
            if callable(setter):
                try:
                    setter()
                except (RuntimeError, ValueError) as err:  # a bad level: what import torch says cold
                    raise TorchRefused(err) from None
            else:
                left.append(name)
        elif name.startswith(_COMPILER_PREFIXES) and not read_by_config_modules(name, modules):
            continue  # read when compiling, after the script set it: it works
        else:
            left.append(name)
    return left


def watch_first_torch_import(start: Mapping[str, str]) -> None:
    """Arm the watch (a warm worker, before its script runs). Imports by unicron's own modules
    do not count: the script's first one does, wherever it is."""
    original = builtins.__import__
    start = dict(start)

    def watching(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (name == "torch" or name.startswith("torch.")):
            caller = (globals or {}).get("__name__", "") if isinstance(globals, dict) else ""
            if not str(caller).startswith(("unicron", "torch")):
                if builtins.__import__ is watching:  # one look; a wrapper set later stays
                    builtins.__import__ = original
                _look(start)
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = watching


def _look(start: Mapping[str, str]) -> None:
    try:
        left = reconcile(changed_since(start, os.environ), sys.modules["torch"])
    except TorchRefused as refused:
        raise refused.error from None
    except Exception as err:  # never fail the script's import for this
        print(f"unicron: could not check the variables the script set before `import torch`: "
              f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return
    if left:
        print(f"unicron: the script set {', '.join(left)} before `import torch`, but this worker was "
              "started with torch already imported (warm start), which read them first; they take "
              "effect with `unicron run --no-warm`", file=sys.stderr, flush=True)
