"""The activity evidence read from real process trees with psutil."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from unicron.agent.usage import tree_usage
from unicron.detect.activity import Activity, ActivityTracker, BusyRule

# A leader that idles while its child computes (a data loader, a helper process), a leader that
# computes itself (a long native call, a spin-wait), and a leader that idles alone (a rank
# waiting in a collective).
BUSY_CHILD = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
              "print('ready', flush=True)\n"
              "try:\n    time.sleep(3600)\nfinally:\n    child.kill(); child.wait()\n")
SPIN = "import time\nprint('ready', flush=True)\nwhile True: pass\n"
IDLE = "import time\nprint('ready', flush=True)\ntime.sleep(3600)\n"
# A collective's traffic through a slow link: 20 KiB written to a socket (writev, as gloo
# sends) 10 times a second, and a logging thread's worth of output: a short line 10 times a second.
SLOW_LINK = ("import os, socket, time\n"
             "a, b = socket.socketpair()\n"
             "print('ready', flush=True)\n"
             "while True:\n"
             "    os.writev(a.fileno(), [b'x' * 20480])\n"
             "    while len(b.recv(65536)) == 65536: pass\n"
             "    time.sleep(0.1)\n")
LOGGING = ("import sys, time\nprint('ready', flush=True)\nlog = open(os.devnull, 'w')\n"
           "while True:\n    log.write('step 12 loss 0.123 lr 1e-4 tokens/s 123456\\n'); log.flush(); time.sleep(0.1)\n")


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in started:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            children = []  # already reaped by the test
        for child in children:
            child.kill()
        proc.kill()
        proc.wait()  # its orphaned child is reaped by init (or the test's subreaper) now
        psutil.wait_procs(children, timeout=10)


def test_a_computing_descendant_is_work_a_computing_leader_is_busy_an_idle_tree_idle(procs) -> None:
    helped, spinning, idle = procs(BUSY_CHILD), procs(SPIN), procs(IDLE)
    tracker = ActivityTracker(BusyRule(window_s=1.0, period_s=0.25))
    expected = {0: Activity.WORKING, 1: Activity.BUSY, 2: Activity.IDLE}
    deadline = time.monotonic() + 30
    verdict = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if tracker.due(now):
            tracker.add(now, {0: tree_usage(helped.pid), 1: tree_usage(spinning.pid), 2: tree_usage(idle.pid)})
            verdict = tracker.levels(now)
            if verdict == expected:  # the trees' start-up has aged out
                break
        time.sleep(0.05)
    assert verdict == expected
    idle.kill()
    idle.wait()
    assert tree_usage(idle.pid) is None


def test_a_slow_links_traffic_is_work_a_logging_thread_is_not(procs) -> None:
    sending, logging = procs(SLOW_LINK), procs("import os\n" + LOGGING)
    tracker = ActivityTracker()  # the default rule
    expected = {0: Activity.WORKING, 1: Activity.IDLE}
    deadline = time.monotonic() + 30
    verdict = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if tracker.due(now):
            tracker.add(now, {0: tree_usage(sending.pid), 1: tree_usage(logging.pid)})
            verdict = tracker.levels(now)
            if verdict == expected:  # the trees' start-up has aged out
                break
        time.sleep(0.05)
    assert verdict == expected


ONE_BIG_WRITE = ("import os, sys\n"
                 "data = bytearray(768 << 20)\n"
                 "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
                 "print('ready', flush=True)\n"
                 "os.write(fd, data)  # one call, as torch.save writes a storage\n"
                 "print('written', flush=True)\n"
                 "os.close(fd)\n"
                 "sys.stdin.read()\n")


def _on_tmpfs(path) -> bool:
    best, kind = "", ""
    for line in open("/proc/mounts").read().splitlines():
        _, point, fstype, *_ = line.split()
        if str(path).startswith(point) and len(point) > len(best):
            best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")


def test_one_long_write_is_io_while_it_runs(tmp_path) -> None:
    """``torch.save`` writes each storage with one ``write()``, which ``wchar`` counts only
    when it returns: a checkpoint of a 2 GB tensor looked like no I/O for as long as it took
    (acceptance pass 14). Storage bytes count as pages are dirtied, during the call."""
    if _on_tmpfs(tmp_path):
        pytest.skip("tmpfs does not account written pages")
    proc = subprocess.Popen([sys.executable, "-c", ONE_BIG_WRITE, str(tmp_path / "big.bin")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        before = tree_usage(proc.pid)
        assert before is not None
        seen_during = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = tree_usage(proc.pid)
            assert now is not None
            if not _inside_write(proc.pid):
                break
            seen_during = max(seen_during, now.io_bytes - before.io_bytes)
            time.sleep(0.005)
        assert seen_during > 64 << 20, seen_during
    finally:
        proc.kill()
        proc.wait()


def _inside_write(pid: int) -> bool:
    """The big write has not returned: ``wchar`` (counted when a call returns) has not got it."""
    fields = dict(line.split(": ") for line in open(f"/proc/{pid}/io").read().splitlines() if ": " in line)
    return int(fields["wchar"]) < 768 << 20
