"""A rank whose script ended cleanly but whose process lives on is named once (real processes)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from unicron.agent.logs import LogSpec, RunLogDir
from unicron.agent.ranks import GroupSpec
from unicron.agent.tee import ConsoleTee
from unicron.agent.workers import WorkerGroup
from unicron.detect.hang import HangDetector

pytestmark = pytest.mark.timeout(60)

SPEC = GroupSpec(attempt=0, restart_count=0, rank_offset=0, world_size=2, node_rank=0, nnodes=1,
                 local_world_sizes=(2,), master_addr="127.0.0.1", master_port=1, restore_step=None, inject="")


def test_a_process_that_outlives_its_script_is_named_once(tmp_path: Path) -> None:
    # Both "scripts" end (bye) and their interpreters linger: a non-daemon thread, say.
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    tee = ConsoleTee()
    group = WorkerGroup(SPEC, cmd=cmd, env_for=lambda *_: {}, run_logs=RunLogDir(LogSpec(log_dir=str(tmp_path)), "j"),
                        tee=tee, host="h", hang=HangDetector(), role="default", stack_dir=str(tmp_path))
    group.linger_s = 0.5
    group.start(time.time())
    try:
        assert group.lingering_notices(time.monotonic()) == []  # nobody said bye: not lingering
        for rank in (0, 1):
            group.on_message({"t": "bye", "rank": rank, "ts": time.time()}, time.time())
        group.ranks[1].proc.popen.send_signal(signal.SIGSTOP)
        assert 0 < group.next_check_s(time.monotonic()) <= 0.5  # the agent wakes for it
        assert group.lingering_notices(time.monotonic()) == []  # not yet
        deadline = time.monotonic() + 10
        notices: list = []
        while len(notices) < 2:
            assert time.monotonic() < deadline, notices
            notices += group.lingering_notices(time.monotonic())
            time.sleep(0.05)
        by_rank = {r.rank: text for r, text in notices}
        assert "rank 0's script ended" in by_rank[0] and "has not exited;" in by_rank[0]
        assert f"(pid {group.ranks[0].proc.pid})" in by_rank[0]
        assert "is stopped (SIGSTOP" in by_rank[1]
        assert group.lingering_notices(time.monotonic() + 100) == []  # once each
        assert group.next_check_s(time.monotonic()) == float("inf")
    finally:
        group.ranks[1].proc.popen.send_signal(signal.SIGCONT)
        group.stop(2.0)
        tee.close()
    group.poll(time.time())
    assert all(r.exitcode is not None for r in group.ranks.values())

