"""What a warm worker does with variables the script set above ``import torch`` (its pure part,
with torch's real config modules): apply, name, leave alone, or fail as torch would."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from unicron.worker import lateenv

pytestmark = pytest.mark.timeout(120)


class FakeTorch:
    def __init__(self) -> None:
        self.threads: list[int] = []

    def set_num_threads(self, n: int) -> None:
        self.threads.append(n)


@pytest.fixture
def compilers() -> dict[str, Any]:
    import torch._dynamo.config  # noqa: F401
    import torch._inductor.config  # noqa: F401

    return dict(sys.modules)


def test_only_what_torch_read_at_import_is_named(compilers: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/cache_rank0")  # read when compiling: it works
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # read as inductor's config imports
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch = FakeTorch()
    changed = ["OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_MAX_AUTOTUNE"]
    assert lateenv.reconcile(changed, torch, compilers) == ["TORCHINDUCTOR_MAX_AUTOTUNE"]
    assert torch.threads == [3]


def test_an_omp_num_threads_the_script_removed_is_named(compilers: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Popping the launcher's OMP_NUM_THREADS=1 gives torch's default under torchrun; a warm
    worker keeps the thread count it was started with, and says so."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch = FakeTorch()
    assert lateenv.reconcile(["OMP_NUM_THREADS"], torch, compilers) == ["OMP_NUM_THREADS"] and not torch.threads


def test_a_torch_logs_torch_refuses_fails_as_it_would_cold(tmp_path) -> None:
    """In a process of its own: a refused setting leaves torch's logging half set up."""
    import subprocess

    child = (
        "import os, sys\n"
        "import torch._logging._internal\n"
        "from unicron.worker import lateenv\n"
        "os.environ['TORCH_LOGS'] = 'bogus_thing'\n"
        "try:\n"
        "    lateenv.reconcile(['TORCH_LOGS'], None)\n"
        "except lateenv.TorchRefused as refused:\n"
        "    print(type(refused.error).__name__, ' '.join(str(refused.error).split())[:200])\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=100)
    assert out.stdout.startswith("ValueError") and "Invalid log settings" in out.stdout, out.stdout + out.stderr


def test_torch_distributed_debug_is_applied_and_cpp_stacktraces_named(tmp_path) -> None:
    """The DDP debugging recipe, ``os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"`` above
    ``import torch``, takes effect in a warm worker as in a cold one."""
    import subprocess

    child = (
        "import os\n"
        "import torch, torch.distributed as dist\n"
        "from unicron.worker import lateenv\n"
        "os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'\n"
        "os.environ['TORCH_SHOW_CPP_STACKTRACES'] = '1'\n"
        "left = lateenv.reconcile(lateenv.changed_since({}, os.environ), torch)\n"
        "print(dist.get_debug_level(), left)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=100,
                         env={k: v for k, v in os.environ.items() if not k.startswith("TORCH")})
    assert "DebugLevel.DETAIL" in out.stdout and "'TORCH_SHOW_CPP_STACKTRACES'" in out.stdout, out.stdout + out.stderr
