"""A rank whose script ended cleanly but whose process lives on is named once (real processes)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from helpers_worker import sleeping_group

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


def test_steps_after_a_ranks_clean_end_mean_the_job_is_not_past_its_last_step(tmp_path: Path) -> None:
    """Acceptance 23C F3: with uneven data a rank that runs out of shards exits 0 while the
    others train on; its clean end turned hang detection off for the rest of the job. Steps of
    the others after it re-arm it; a tail after the last step (no step after the end) does not."""
    group, tee = sleeping_group(tmp_path, 3)
    group.start(time.time())
    try:
        t0 = time.time()
        for rank in (0, 1, 2):
            group.on_message({"t": "step", "rank": rank, "step": 10, "ts": t0}, t0)
        group.on_message({"t": "bye", "rank": 2, "ts": t0 + 0.1}, t0 + 0.1)
        assert group.past_last_step()  # nobody stepped since: maybe the job's end
        for rank in (0, 1):  # reports of the same last step may come after the bye
            group.on_message({"t": "step", "rank": rank, "step": 11, "ts": t0 + 0.2}, t0 + 0.2)
        assert group.past_last_step()
        for rank in (0, 1):
            group.on_message({"t": "step", "rank": rank, "step": 12, "ts": t0 + 0.25}, t0 + 0.25)
        assert not group.past_last_step()  # the others train on without rank 2
        group.on_message({"t": "bye", "rank": 0, "ts": t0 + 0.3}, t0 + 0.3)
        assert group.past_last_step()  # rank 1's tail after its last step
    finally:
        group.stop(2.0)
        tee.close()
