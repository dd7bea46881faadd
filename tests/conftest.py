"""Fixtures for the end-to-end tests; make sure nothing a test started outlives it."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e import SCRIPTS, Launched


def _ours(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            # Forked (warm) workers show their zygote's command line: their directory names them.
            if any(marker in part for part in proc.info["cmdline"] or ()) or _cwd(proc).startswith(marker):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _cwd(proc: psutil.Process) -> str:
    try:
        return proc.cwd()
    except (psutil.Error, OSError):
        return ""


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """A directory with copies of the test scripts; after the test no process that mentions
    it may be alive (the check polls briefly, then kills leftovers and fails the test)."""
    for script in SCRIPTS.glob("*.py"):
        shutil.copy(script, tmp_path / script.name)
    yield tmp_path
    marker = str(tmp_path)
    deadline = time.monotonic() + 15
    while _ours(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _ours(marker)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    assert not left, f"orphaned processes: {[(p.pid, p.info['cmdline']) for p in left]}"


@pytest.fixture
def launch() -> Iterator[Any]:
    started: list[Launched] = []

    def start(args: list[str], cwd: Path, env: dict[str, str] | None = None, **popen: Any) -> Launched:
        item = Launched(args, cwd, env, **popen)
        started.append(item)
        return item

    yield start
    for item in started:
        item.kill()
        if item.proc.stdout:
            item.proc.stdout.close()
        if item.proc.stderr:
            item.proc.stderr.close()




# ---- order: long modules first, each worker's share long to short -------------------------------
# xdist's worksteal hands each worker a contiguous third of the list and lets idle workers steal
# the end of a busy one's queue. In file order one third held most of the long end-to-end tests
# and the run ended on a few 40-50 s ones. Here every worker's third starts with long modules
# (balanced by their tests' recorded seconds, tests/durations.json: ordering only, never a
# verdict) and ends with short ones, which are what gets stolen last. Modules stay whole, so a
# module's shared fixture (a reference run) is set up once per worker that runs it.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import json

    try:
        seconds: dict[str, float] = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), 1)
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    weight = {name: sum(seconds.get(i.nodeid, 0.5) for i in group) for name, group in modules.items()}
    # The counts xdist's first hand-out gives each worker: shares must match them to line up.
    room, left = [], len(items)
    for n in range(workers, 0, -1):
        room.append(left // n)
        left -= left // n
    shares: list[list[pytest.Item]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for name in sorted(modules, key=lambda m: (-weight[m], m)):  # longest first, to the least loaded
        group = modules[name]
        fits = [w for w in range(workers) if room[w] - len(shares[w]) >= len(group)]
        if fits:
            least = min(fits, key=lambda w: loads[w])
            shares[least] += group
            loads[least] += weight[name]
            continue
        for w in sorted(range(workers), key=lambda w: len(shares[w]) - room[w]):  # split: no share has room
            take = max(room[w] - len(shares[w]), 0)
            shares[w] += group[:take]
            group = group[take:]
        shares[-1] += group
    items[:] = [item for share in shares for item in share]
