"""Process trees read from /proc/PID/task/TID/children, checked against psutil on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from unicron.agent.proctree import children_of, exiting_from_stat, is_exiting, tree_of

# A leader with two children, one of which has a child of its own; all wait on stdin.
TREE = ("import subprocess, sys\n"
        "inner = \"import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()\"\n"
        "a = subprocess.Popen([sys.executable, '-c', inner], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "b = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], stdin=subprocess.PIPE)\n"
        "grand = a.stdout.readline().strip()\n"
        "print(a.pid, b.pid, grand, flush=True)\n"
        "sys.stdin.read()\n"
        "a.stdin.close(); b.stdin.close(); a.wait(); b.wait()\n")


def test_tree_matches_psutil_and_a_gone_pid_has_no_children() -> None:
    leader = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout is not None
        a, b, grand = (int(x) for x in leader.stdout.readline().split())
        assert sorted(children_of(leader.pid)) == sorted([a, b])
        assert children_of(a) == [grand] and children_of(grand) == []
        tree = tree_of(leader.pid)
        assert tree[0] == leader.pid and sorted(tree) == sorted([leader.pid, a, b, grand])
        expected = {p.pid for p in psutil.Process(leader.pid).children(recursive=True)} | {leader.pid}
        assert set(tree) == expected
        assert os.getpid() not in tree
    finally:
        assert leader.stdin is not None
        leader.stdin.close()  # each process exits once its stdin closes, and reaps its children
        leader.wait(30)
    assert children_of(leader.pid) == [] and tree_of(leader.pid) == [leader.pid]


def test_a_process_counts_as_exiting_from_the_start_of_its_exit() -> None:
    # /proc/PID/stat lines: the command name may hold spaces and ')'; flags are field 9.
    running = b"4242 (python) S 1 4242 4242 0 -1 4194560 100 0 0 0 5 1 0 0 20 0 9 0 1000 0 0\n"
    exiting = b"4242 (a b) c)) R 1 4242 4242 0 -1 4194564 100 0 0 0 5 1 0 0 20 0 9 0 1000 0 0\n"
    zombie = b"4242 (python) Z 1 4242 4242 0 -1 4227332 100 0 0 0 5 1 0 0 20 0 1 0 1000 0 0\n"
    assert not exiting_from_stat(running)
    assert exiting_from_stat(exiting)  # PF_EXITING (0x4) set: its sockets are about to close
    assert exiting_from_stat(zombie)
    # Real processes: alive, then a zombie (not reaped yet), then gone.
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert not is_exiting(proc.pid) and not is_exiting(os.getpid())
        assert proc.stdin is not None
        proc.stdin.close()
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert is_exiting(proc.pid)
    finally:
        proc.kill()
        proc.wait()
