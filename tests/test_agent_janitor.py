"""The agent's janitor (``unicron.agent.janitor``): the directories go when their agent dies
without removing them, and the watcher itself is reaped when the agent exits normally."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from unicron.agent.janitor import Janitor

ROOT = Path(__file__).resolve().parents[1]


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_directories_go_when_their_owner_is_sigkilled(tmp_path: Path) -> None:
    held = tmp_path / "snapshots"
    (held / "rank0").mkdir(parents=True)
    (held / "rank0" / "slot0.bin").write_bytes(b"x" * 4096)
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom unicron.agent.janitor import Janitor\n"
         f"j = Janitor([{str(held)!r}])\nprint(j.pid, flush=True)\ntime.sleep(600)\n"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        janitor = psutil.Process(int(owner.stdout.readline()))
        assert held.exists()  # nothing is removed while the owner lives
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        _wait(lambda: not held.exists(), 10, "the janitor to remove the directory")
        janitor.wait(10)  # it ends once its work is done (psutil.TimeoutExpired otherwise)
        assert not janitor.is_running()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


# A stand-in agent: a janitor with a marker, then a process started in a session of its own
# (a daemon the worker started) with the marker in its environment, and one without it.
OWNER = """\
import os, subprocess, sys, time
from unicron.agent.janitor import Janitor
marker = "UNICRON_AGENT_ADDR=ipc://" + sys.argv[1]
j = Janitor([], marker=marker)
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
marked = subprocess.Popen(sleeper, env={**os.environ, "UNICRON_AGENT_ADDR": marker.partition("=")[2]},
                          start_new_session=True)
other = subprocess.Popen(sleeper, start_new_session=True)
print(j.pid, marked.pid, other.pid, flush=True)
if sys.argv[2] == "close":
    j.close()
    print("closed", flush=True)
time.sleep(600)
"""


def _owner_leaves(tmp_path: Path, how: str) -> tuple[psutil.Process, psutil.Process]:
    """Start the stand-in agent, end it ``how`` (SIGKILL, or a clean close then SIGKILL); return
    its marked and unmarked daemons (the caller reaps what is left)."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "agent.sock"), how], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        janitor_pid, marked_pid, other_pid = (int(p) for p in owner.stdout.readline().split())
        marked, other = psutil.Process(marked_pid), psutil.Process(other_pid)
        if how == "close":
            # Not looked up: the owner may have closed and reaped it already (a race this test
            # lost on a loaded machine, NoSuchProcess); it says "closed" once it has.
            assert owner.stdout.readline().strip() == "closed"
        else:
            janitor = psutil.Process(janitor_pid)  # alive until the owner dies: it waits for that
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        if how != "close":
            janitor.wait(10)
        return marked, other
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_the_workers_leftovers_go_when_the_agent_is_sigkilled(tmp_path: Path) -> None:
    marked, other = _owner_leaves(tmp_path, "kill")
    try:
        _wait(lambda: not marked.is_running() or marked.status() == psutil.STATUS_ZOMBIE, 10,
              "the janitor to kill the marked daemon")
        assert other.is_running() and other.status() != psutil.STATUS_ZOMBIE, "only the agent's own are killed"
    finally:
        for proc in (marked, other):
            if proc.is_running():
                proc.kill()


def test_a_clean_end_kills_nothing(tmp_path: Path) -> None:
    marked, other = _owner_leaves(tmp_path, "close")
    try:
        assert marked.is_running() and marked.status() != psutil.STATUS_ZOMBIE
    finally:
        for proc in (marked, other):
            if proc.is_running():
                proc.kill()


def test_closing_lets_the_watcher_go_and_reaps_it(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    kept.mkdir()
    janitor = Janitor([str(tmp_path / "already-removed")])
    pid = janitor.pid
    assert pid is not None and psutil.pid_exists(pid)
    janitor.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert kept.exists()
    janitor.close()  # twice is harmless
    assert os.path.isdir(kept)


@pytest.mark.timeout(240)
def test_the_janitor_outlives_restarts_and_goes_with_its_agent(workdir: Path) -> None:
    """The janitor is the agent's child but no worker's leftover: a restart (which stops every
    adopted orphan with the attempt) leaves it alone, and the agent reaps it at its end."""
    import shutil

    from e2e import SCRIPTS, Launched, read_events, wait_for

    shutil.copy(SCRIPTS / "train_state.py", workdir)
    logs = workdir / "logs"
    job = Launched(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--grace-period", "60",
                    "--inject", "kill@0:3", "--log-dir", str(logs), str(workdir / "train_state.py"), "--steps", "40",
                    "--sleep", "0.05", "--out", str(workdir / "out.txt")], workdir)
    try:
        def janitors() -> list[psutil.Process]:
            return [c for c in psutil.Process(job.proc.pid).children() if "-S" in c.cmdline()]

        janitor = wait_for(lambda: janitors() or None, 60, "the janitor")[0]
        # Timed from the kill, not from the start: a loaded machine can take long to import torch.
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "fault"], 120, "the injected kill")
        # With the janitor taken for an orphan, attempt 1 would wait out the 60 s grace period
        # for it (it ignores SIGTERM), then kill it and start without it.
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "workers_started" and e["attempt"] == 1],
                 50, "attempt 1 to start")
        assert janitor.is_running() and janitor.status() != psutil.STATUS_ZOMBIE
        code, out, err = job.wait(60)
    finally:
        job.kill()
    assert code == 0, err
    assert not janitor.is_running()
