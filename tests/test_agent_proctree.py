"""Process trees read from /proc/PID/task/TID/children, checked against psutil on real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from unicron.agent.proctree import children_of, tree_of

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
