"""Imported first by the worker's entry modules (``python -m unicron.worker.boot`` and
``python -m unicron.worker.zygote``): ``python -m`` puts the working directory first on
``sys.path``, ahead of the standard library, while torchrun's ``python SCRIPT`` puts only the
script's directory there. A file in the launcher's working directory named like a module the
worker imports (``tokenize.py``, ``queue.py``, ``profile.py``: torch imports them) was imported
in its place and broke every rank of a script run from elsewhere (``unicron run scripts/x.py``).
``boot.run_target`` puts the script's own entry first, as python does.
"""

from __future__ import annotations

import os
import sys

ENTRY_MODULES = ("unicron.worker.boot", "unicron.worker.zygote")


def drop_cwd() -> None:
    """Take the working directory off the front of ``sys.path`` in an entry module run as
    ``__main__`` (an import of ``boot`` elsewhere, a test's, leaves its process alone)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) not in ENTRY_MODULES or not sys.path or getattr(sys.flags, "safe_path", False):
        return
    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under it
        return
    if sys.path[0] in (cwd, ""):
        del sys.path[0]


drop_cwd()
