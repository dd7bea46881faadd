"""Does the main thread come back to the interpreter? (one long native call, or many short ones)

A loop of native calls (``for chunk in chunks: sims.append(q @ chunk.T)``, an evaluation that is
one big op per batch) looks to a frame sampler exactly like one long native call: the sampler
gets the GIL only while an op has released it, so every sample finds the main thread at the same
call instruction of the same frame. What tells them apart is whether the main thread returns to
the interpreter between samples: a pending call (``Py_AddPendingCall``) is run by the main
thread at its next bytecode boundary, so one scheduled now has run by the next sample only if the
native call it was in ended. It runs no user code and raises nothing; nothing is sent to the
process (a signal would interrupt the blocking system calls of native code that may not retry).
"""

from __future__ import annotations

import ctypes
from typing import Any

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class MainThreadReturns:
    """``returned()``: whether the main thread reached a bytecode boundary since the previous
    call (False the first time, and always where pending calls are unavailable)."""

    def __init__(self) -> None:
        self.count = 0  # pending calls the main thread ran
        self._seen: int | None = None  # ``count`` at the previous ``returned()``
        self._scheduled = False
        self._add: Any = None
        self._callback: Any = None
        try:
            self._add = ctypes.pythonapi.Py_AddPendingCall
            self._add.argtypes = (_CALLBACK, ctypes.c_void_p)
            self._add.restype = ctypes.c_int
            self._callback = _CALLBACK(self._ran)  # kept: the interpreter holds only its address
        except (AttributeError, TypeError):  # not CPython: no evidence, as before
            self._add = None

    def _ran(self, _arg: Any) -> int:
        self.count += 1
        self._scheduled = False
        return 0  # non-zero would raise in the main thread

    def reset(self) -> None:
        """Forget the previous sample (sampling pauses: a step came)."""
        self._seen = None

    def returned(self) -> bool:
        """Whether the pending call scheduled by the previous ``returned()`` has run; schedules
        the next one."""
        ran = self._seen is not None and self.count != self._seen
        self._seen = self.count
        if self._add is not None and not self._scheduled:
            self._scheduled = self._add(self._callback, None) == 0  # -1: the queue is full, try again
        return ran
