"""Every benchmark script still starts: its imports resolve and its flags parse (`--help`).

The benchmarks are run by hand, not in CI, so a refactor that moves a function they import
broke `scripts/bench_warm.py` unnoticed (it imported ``terminate_all`` from its old module).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("bench_*.py")) + [ROOT / "scripts" / "gpu_checks.py"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_the_script_imports_and_parses_its_flags(script: Path) -> None:
    done = subprocess.run([sys.executable, str(script), "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout
