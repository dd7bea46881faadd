"""Helpers for the end-to-end tests: run `unicron` as a real command and read its event log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def unicron_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "unicron", *args]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "UNICRON_", "TORCHELASTIC_", "SLURM_"))}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(log_dir.rglob("events.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    return sorted(events, key=lambda e: e["ts"])




class Launched:
    """A `unicron` command running in the background, always reaped."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None, **popen: Any) -> None:
        self.proc = subprocess.Popen(unicron_cmd(*args), cwd=cwd, env=env or clean_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, **popen)

    def wait(self, timeout: float) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"unicron did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}") from None
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_unicron(args: list[str], cwd: Path, timeout: float = 90, env: dict[str, str] | None = None
                ) -> tuple[int, str, str]:
    item = Launched(args, cwd, env)
    try:
        return item.wait(timeout)
    finally:
        item.kill()


def remove_cgroup(group: Path, timeout: float = 30) -> None:
    """Remove a cgroup a test made, once the processes in it are gone (a cgroup holding a
    process cannot be removed; the test reaps them, the kernel then empties it)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            group.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
