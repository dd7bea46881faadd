"""Variables a script sets before ``import torch``, in a worker forked with torch imported.

A warm worker (``unicron.worker.zygote``) starts with torch, torch._dynamo and the inductor
config already imported, so what torch reads while importing was read before the script ran.
A script that sets, say, ``os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"`` or
``OMP_NUM_THREADS`` above its ``import torch`` gets its value under torchrun and would silently
not under unicron. So the script's first ``import torch`` (``from torch ...``) is watched: what
the script changed since the worker started is applied where torch can take it again
(``OMP_NUM_THREADS``: ``torch.set_num_threads``; ``TORCH_LOGS``: torch's logging set up again)
and named on stderr where it cannot (dynamo's and inductor's configs, the OpenMP/MKL runtimes),
with the fix: ``--no-warm``. Variables torch reads later (process group, CUDA allocator) are
left alone: they work either way.
"""

from __future__ import annotations

import builtins
import os
import sys
from collections.abc import Mapping
from typing import Any

# Read while torch (or its OpenMP/MKL runtimes, dynamo, inductor) imports: too late once imported.
_READ_AT_IMPORT = ("TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHELASTIC_ENABLE_FILE_TIMER",
                   "TORCH_CPP_LOG_LEVEL", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_")
_REAPPLIED = ("OMP_NUM_THREADS", "TORCH_LOGS", "TORCH_LOGS_OUT", "TORCH_LOGS_FORMAT")


def changed_since(start: Mapping[str, str], now: Mapping[str, str]) -> list[str]:
    """Variables torch reads while importing whose value the script changed (pure)."""
    names = {n for n in (*start, *now) if n.startswith(_READ_AT_IMPORT) or n in _REAPPLIED}
    return sorted(n for n in names if start.get(n) != now.get(n))


def reconcile(changed: list[str], torch: Any) -> list[str]:
    """Apply what torch can take again; returns the names it cannot."""
    left = []
    for name in changed:
        if name == "OMP_NUM_THREADS":
            try:
                threads = int(os.environ.get(name, "").strip())
            except ValueError:
                continue  # torch ignores a value it cannot parse
            if threads > 0:
                torch.set_num_threads(threads)
        elif name.startswith("TORCH_LOGS"):
            logging_internal = sys.modules.get("torch._logging._internal")
            if logging_internal is not None and callable(getattr(logging_internal, "_init_logs", None)):
                logging_internal._init_logs()
            else:
                left.append(name)
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
    except Exception as err:  # never fail the script's import for this
        left = [f"({type(err).__name__}: {err})"]
    if left:
        print(f"unicron: the script set {', '.join(left)} before `import torch`, but this worker was "
              "started with torch already imported (warm start), which read them first; they take "
              "effect with `unicron run --no-warm`", file=sys.stderr, flush=True)
