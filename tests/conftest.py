"""Fixtures for the end-to-end tests; make sure nothing a test started outlives it."""

from __future__ import annotations

import os
import shutil
import threading
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




@pytest.fixture
def subreaper() -> Iterator[None]:
    """This test process is a child subreaper for the test, as the agent always is (tests of
    processes forked by a zygote, re-parented to us)."""
    from unicron.agent.signals import set_child_subreaper

    assert set_child_subreaper(True)
    try:
        yield
    finally:
        set_child_subreaper(False)


@pytest.fixture(autouse=True)
def _no_import_left_running() -> Iterator[None]:
    """A coordinator imports torch on a thread as it starts (``unicron.coord.stores.preload``),
    and the thread outlives a short test. The next test in the same process then met numpy half
    imported (``pytest.approx`` looks numpy up in ``sys.modules``: "partially initialized module
    'numpy' has no attribute 'isscalar'"). Each test waits for the import it started."""
    yield
    for thread in threading.enumerate():
        if thread.name == "unicron-preload":
            thread.join(120)
