"""Whether a warm start can be exactly a cold one, and what a zygote is told: pure checks.

``unicron.agent.warm`` starts a worker from its zygote only when the worker would be the same
as one started cold by ``python -u -m unicron.worker.boot``: same python, same variables read at
import time, no preloaded package shadowed by the script's directory. Pure, except for the file
system lookups of ``shadowed_preloads``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

from unicron.agent.logs import RankLogs

BOOT_MODULE = "unicron.worker.boot"

# Read while python starts or torch/numpy/OpenMP load: a zygote imported under its own values.
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH", "PYTORCH_", "OMP_", "KMP_", "GOMP_",
                         "MKL_", "OPENBLAS_", "NUMPY_", "LC_")
_IMPORT_TIME_NAMES = frozenset({"LANG", "LANGUAGE", "HOME", "TMPDIR", "TEMP", "TMP"})
# Read later (process group init, elastic error handling) or re-applied by the zygote.
_RUNTIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHON_EXEC")
_REAPPLIED = frozenset({"OMP_NUM_THREADS"})  # torch.set_num_threads in the zygote


def is_import_time(name: str) -> bool:
    """Whether a variable may already have been read when a zygote finished importing."""
    if name in _REAPPLIED or name.startswith(_RUNTIME_PREFIXES):
        return False
    return name in _IMPORT_TIME_NAMES or name.startswith(_IMPORT_TIME_PREFIXES)


def import_env_mismatch(zygote_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Import-time variables whose value (or presence) differs: a warm start would not be cold's."""
    names = {n for n in (*zygote_env, *worker_env) if is_import_time(n)}
    return sorted(n for n in names if zygote_env.get(n) != worker_env.get(n))


# Top-level packages the zygote imports before any worker exists (unicron.worker.zygote.PRELOAD).
PRELOADED_ROOTS = ("numpy", "torch", "zmq")


def shadowed_preloads(argv: Sequence[str], cwd: str) -> list[str]:
    """Preloaded packages that a cold worker would import from the script's own directory instead.

    A cold ``python -m unicron.worker.boot SCRIPT`` puts the script's directory (``-m``: the
    working directory) first on ``sys.path``; a ``torch/`` or ``numpy.py`` there would win over
    the installed one, which a fork of the zygote has already imported. Pure, except for the
    file system lookups."""
    if argv and argv[0] in ("--module", "-m"):
        first = cwd
    else:
        script = argv[1] if argv and argv[0] == "--" and len(argv) > 1 else (argv[0] if argv else "")
        path = os.path.realpath(os.path.join(cwd, script))
        first = path if os.path.isdir(path) else os.path.dirname(path)  # python DIR: DIR is first
    found = []
    for root in PRELOADED_ROOTS:
        base = os.path.join(first, root)
        if os.path.isdir(base) or any(os.path.exists(base + ext) for ext in (".py", ".pyc", ".so")):
            found.append(root)
    return found


def boot_argv(cmd: Sequence[str], python: str) -> list[str] | None:
    """``[(--module) SCRIPT ARGS]`` of a boot command run by ``python``, else None."""
    head = [python, "-u", "-m", BOOT_MODULE]
    if len(cmd) <= len(head) or list(cmd[: len(head)]) != head:
        return None
    return list(cmd[len(head):])




REFILL_DELAY_S = 30.0  # restart a zygote that died anyway this long after an attempt started


def should_refill(now: float, attempt_started_at: float, steps_completed: int, *,
                  delay_s: float = REFILL_DELAY_S) -> bool:
    """When to restart a zygote that died: once the attempt completed a step, or ``delay_s`` after it began.

    Not at once: a new zygote importing torch would compete for CPU with the workers that are
    starting. Calling ``refill`` while the zygote lives is cheap.
    """
    return steps_completed > 0 or now - attempt_started_at >= delay_s


def spec_line(argv: Sequence[str], env: Mapping[str, str], cwd: str, logs: RankLogs) -> bytes:
    """The one line a zygote reads to fork a worker."""
    spec = {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": logs.stdout_path,
            "stderr": logs.stderr_path}
    return json.dumps(spec, separators=(",", ":")).encode() + b"\n"
