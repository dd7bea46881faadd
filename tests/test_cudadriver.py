"""unicron.worker.cudadriver against a libcuda built here (this machine has no GPU): the driver
is found in the process's maps, a loaded driver is told from an initialised one, the zygote
refuses to fork only from the latter, and host registration reaches the driver with its flags.
The real driver's answers are recorded by scripts/gpu_checks.py (warm, snapshot)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from unicron.worker import cudadriver

# What the real driver does for the calls unicron makes: every call before cuInit answers
# CUDA_ERROR_NOT_INITIALIZED (3); registration wants a live driver and remembers its flags.
FAKE_DRIVER = r"""
static int initialised = 0;
static unsigned int last_flags = 99;
static unsigned long registered = 0;
int cuInit(unsigned int flags) { initialised = 1; return 0; }
int cuDeviceGetCount(int *count) { if (!initialised) return 3; *count = 1; return 0; }
int cuMemHostRegister_v2(void *p, unsigned long n, unsigned int flags) {
    if (!initialised) return 3;
    if (!p || !n) return 1;
    last_flags = flags; registered = n; return 0;
}
int cuMemHostUnregister(void *p) { if (!initialised) return 3; if (!registered) return 712; registered = 0; return 0; }
unsigned int fake_last_flags(void) { return last_flags; }
unsigned long fake_registered(void) { return registered; }
"""

PROBE = r"""
import ctypes, json, sys
from unicron.worker import cudadriver, zygote

def preload_refusal():
    try:
        zygote._preload()
        return None
    except RuntimeError as err:
        return str(err)

out = {"before_load": cudadriver.driver_state()}
lib = ctypes.CDLL(sys.argv[1])
buf = ctypes.create_string_buffer(8192)
out["loaded"] = cudadriver.driver_state()
out["path"] = cudadriver.loaded_path()
out["refusal_loaded"] = preload_refusal()
out["register_uninitialised"] = cudadriver.register_host(ctypes.addressof(buf), 8192)
lib.cuInit(0)
out["initialised"] = cudadriver.driver_state()
out["refusal_initialised"] = preload_refusal()
out["register"] = cudadriver.register_host(ctypes.addressof(buf), 8192)
lib.fake_registered.restype = ctypes.c_ulong
out["flags"], out["bytes"] = lib.fake_last_flags(), lib.fake_registered()
out["unregister"] = cudadriver.unregister_host(ctypes.addressof(buf))
out["unregister_again"] = cudadriver.unregister_host(ctypes.addressof(buf))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in driver")
    directory = tmp_path_factory.mktemp("driver")
    (directory / "fake.c").write_text(FAKE_DRIVER)
    lib = directory / "libcuda.so.1"  # the name the maps are searched for
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(directory / "fake.c")], check=True, timeout=60)
    return lib


def test_the_driver_is_found_in_the_maps_by_its_file(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 1    /usr/lib/x86_64-linux-gnu/libc.so.6\n"
                    "7f01-7f02 rw-p 00000000 00:00 0 \n")
    assert cudadriver.loaded_path(str(maps)) is None
    assert cudadriver.driver_state(str(maps)) == cudadriver.ABSENT
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 00000000 08:01 2    /usr/lib/x86_64-linux-gnu/libcuda.so.550.54\n")
    assert cudadriver.loaded_path(str(maps)) == "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54"
    # listed but not actually mapped into this process: RTLD_NOLOAD finds nothing, so nothing is loaded
    assert cudadriver.driver_state(str(maps)) == cudadriver.ABSENT
    assert cudadriver.loaded_path(str(tmp_path / "missing")) is None
    assert cudadriver.driver_state() == cudadriver.ABSENT  # this CPU-only test process, torch imported


def test_a_loaded_driver_is_forkable_and_an_initialised_one_is_not(fake_libcuda: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, str(fake_libcuda)], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before_load"] == "absent"
    assert out["loaded"] == "loaded" and out["path"] == str(fake_libcuda)
    assert out["refusal_loaded"] is None  # torch's CUDA 13 builds map libcuda on import: still a zygote
    assert out["register_uninitialised"] == cudadriver.CUDA_ERROR_NOT_INITIALIZED
    assert out["initialised"] == "initialized"
    assert out["refusal_initialised"] == ("importing initialised the CUDA driver (cuInit); "
                                          "workers cannot be forked from it")
    assert out["register"] == 0 and out["flags"] == cudadriver.CU_MEMHOSTREGISTER_PORTABLE and out["bytes"] == 8192
    assert out["unregister"] == 0 and out["unregister_again"] == 712  # the stand-in remembers one registration
