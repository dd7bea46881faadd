"""The live view in a real terminal (tmux) while a real job loses a rank and heals.

Pane "run": `unicron run --standalone --nproc-per-node 2 --max-restarts 3 --inject kill@1:STEP
examples/train_gpt.py`.
Pane "watch": `unicron status --watch`, found through the run registry. The test reads the
watch pane's screen with `tmux capture-pane` and checks that it showed the job running, then
the restart and its cause, and that the watch exited 0 saying the run ended.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")]

ROOT = Path(__file__).resolve().parent.parent
FAULT_STEP = 8
STEPS = 24


class Tmux:
    """A private tmux server (its own socket), so the test touches no user session."""

    def __init__(self) -> None:
        self.socket = f"unicron-test-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, "-f", "/dev/null", *args], check=True,
                             capture_output=True, text=True, timeout=10)
        return out.stdout

    def screen(self, window: str) -> str:
        return self("capture-pane", "-p", "-t", window)

    def pane_pids(self) -> list[int]:
        try:
            return [int(p) for p in self("list-panes", "-a", "-F", "#{pane_pid}").split()]
        except subprocess.CalledProcessError:
            return []

    def kill(self) -> None:
        procs = []
        for pid in self.pane_pids():
            try:
                parent = psutil.Process(pid)
                procs += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)
        for proc in procs:  # a job whose terminal vanished must not outlive the test
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)


@pytest.fixture()
def tmux() -> Iterator[Tmux]:
    t = Tmux()
    try:
        yield t
    finally:
        t.kill()


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_live_view_through_an_injected_kill(tmux: Tmux, tmp_path: Path) -> None:
    runs, logs = tmp_path / "runs", tmp_path / "logs"
    # COLUMNS/LINES inherited from a test runner would override the pane's real size.
    env = (f"cd {shlex.quote(str(ROOT))} && unset COLUMNS LINES && export UNICRON_RUNS_DIR={shlex.quote(str(runs))} "
           f"PYTHONPATH={shlex.quote(str(ROOT))} && ")
    py = shlex.quote(sys.executable)
    run_cmd = (f"{py} -m unicron run --standalone --nproc-per-node 2 --max-restarts 3 --log-dir {shlex.quote(str(logs))} "
               f"--inject kill@1:{FAULT_STEP} examples/train_gpt.py --steps {STEPS}; "
               f"echo $? > {shlex.quote(str(tmp_path / 'run.rc'))}")
    watch_cmd = (f"{py} -m unicron status --watch --interval 0.2 --timeout 2; "
                 f"echo $? > {shlex.quote(str(tmp_path / 'watch.rc'))}; sleep 600")
    tmux("new-session", "-d", "-s", "t", "-n", "run", "-x", "120", "-y", "50", env + run_cmd)
    wait_for(lambda: list(runs.glob("*.json")) if runs.exists() else None, 60, "the run to register")
    # A session of its own gets the full 120x50 size (a new window would get tmux's default).
    tmux("new-session", "-d", "-s", "w", "-n", "watch", "-x", "120", "-y", "50", env + watch_cmd)

    seen: dict[str, str] = {}

    def watch_progress() -> bool:
        screen = tmux.screen("w:watch")
        if "unicron status" in screen and "running" in screen and "rank" in screen:
            seen.setdefault("running", screen)
        # A whole frame only (its bottom border drawn): tmux may show one half redrawn.
        if ("restarts 1/" in screen or "restarting" in screen) and "╰" in screen:
            seen.setdefault("restart", screen)
        if "ended" in screen:
            seen.setdefault("ended", screen)
        return (tmp_path / "watch.rc").exists()

    try:
        wait_for(watch_progress, 100, "the watch to end")
    except AssertionError:
        pytest.fail(f"watch did not end; run pane:\n{tmux.screen('t:run')}\nwatch pane:\n{tmux.screen('w:watch')}")
    assert (tmp_path / "watch.rc").read_text().strip() == "0"
    assert "running" in seen, tmux.screen("w:watch")
    assert "restart" in seen, f"the restart never showed:\n{tmux.screen('w:watch')}"
    restart_screen = seen["restart"]
    assert "restarts (1)" in restart_screen or "restarting" in restart_screen
    assert "ended (done, exit 0" in seen["ended"], seen["ended"]
    print(seen["restart"], seen["ended"], sep="\n")  # shown with -s: what the user saw
    wait_for(lambda: (tmp_path / "run.rc").exists(), 60, "the run to exit")
    assert (tmp_path / "run.rc").read_text().strip() == "0", tmux.screen("t:run")
    events = list(logs.rglob("events.jsonl"))
    assert events, "the run wrote no event log"
