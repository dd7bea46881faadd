"""The CUDA driver (libcuda) through ctypes, for the two things torch does not expose.

- ``driver_state()``: whether this process has *initialised* the driver (``cuInit``), which is
  what makes a fork unable to use CUDA. Merely having libcuda mapped is harmless: CUDA builds
  of torch from 2.11 (CUDA 13) map it on ``import torch``, and a fork of such a process
  initialises CUDA and NCCL normally (``scripts/gpu_checks.py`` warm). So the zygote refuses to
  fork only from an initialised driver.
- ``register_host`` / ``unregister_host``: page-lock a snapshot slot's shared-memory mapping,
  so the device-to-host copies into it are real asynchronous DMA at full bandwidth instead of
  a staged copy through a bounce buffer (``cuMemHostRegister``; the driver API, because a
  failed runtime call would leave a "last error" that torch raises at its next kernel launch).

Only a libcuda already mapped into the process is used (``RTLD_NOLOAD``): nothing here loads the
driver or initialises it.
"""

from __future__ import annotations

import ctypes
import os

CUDA_SUCCESS = 0
CUDA_ERROR_NOT_INITIALIZED = 3
CU_MEMHOSTREGISTER_PORTABLE = 0x01  # pinned for every context, not just the current one

ABSENT, LOADED, INITIALIZED = "absent", "loaded", "initialized"


def loaded_path(maps: str = "/proc/self/maps") -> str | None:
    """The file of the libcuda mapped into this process, or None (also where maps cannot be read)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:  # address perms offset device inode path
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and "/libcuda.so" in fields[5]:
                    return fields[5].strip()
    except OSError:
        pass
    return None


def _library(maps: str = "/proc/self/maps") -> ctypes.CDLL | None:
    path = loaded_path(maps)
    if path is None:
        return None
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:  # unmapped since, or not a loadable library after all
        return None


def driver_state(maps: str = "/proc/self/maps") -> str:
    """``absent`` (libcuda not mapped), ``loaded`` (mapped, ``cuInit`` never called), or
    ``initialized`` (anything else: a driver that answers, or one whose cuInit failed)."""
    lib = _library(maps)
    if lib is None:
        return ABSENT
    count = ctypes.c_int(0)
    # Before cuInit every driver call answers CUDA_ERROR_NOT_INITIALIZED, and none initialises.
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return LOADED if rc == CUDA_ERROR_NOT_INITIALIZED else INITIALIZED


def register_host(address: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``address`` for the GPUs; the driver's result code
    (0: done). Needs the driver initialised and a context current on this thread (torch's,
    after any CUDA call on it)."""
    lib = _library()
    if lib is None:
        return CUDA_ERROR_NOT_INITIALIZED
    register = getattr(lib, "cuMemHostRegister_v2", None) or lib.cuMemHostRegister
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    return int(register(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), CU_MEMHOSTREGISTER_PORTABLE))


def unregister_host(address: int) -> int:
    """Undo ``register_host`` (before the memory is unmapped); the driver's result code."""
    lib = _library()
    if lib is None:
        return CUDA_ERROR_NOT_INITIALIZED
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    return int(lib.cuMemHostUnregister(ctypes.c_void_p(address)))
