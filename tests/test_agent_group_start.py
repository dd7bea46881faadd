"""Starting a node's ranks leaves room for the agent's heartbeat between two (real processes)."""

from __future__ import annotations

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

SPEC = GroupSpec(attempt=0, restart_count=0, rank_offset=4, world_size=8, node_rank=1, nnodes=2,
                 local_world_sizes=(4, 4), master_addr="127.0.0.1", master_port=1, restore_step=None, inject="")


def test_the_agent_ticks_between_two_ranks_it_starts(tmp_path: Path) -> None:
    """Acceptance 19B F5: 24 ranks forked on a busy host took the agent 10 s with no heartbeat,
    and its own coordinator declared the node lost before the first step. The agent now gets
    a turn (its heartbeat, when due) after every rank but the last."""
    tee = ConsoleTee()
    group = WorkerGroup(SPEC, cmd=[sys.executable, "-c", "import time; time.sleep(60)"], env_for=lambda *_: {},
                        run_logs=RunLogDir(LogSpec(log_dir=str(tmp_path)), "j"), tee=tee, host="h",
                        hang=HangDetector(), role="default", stack_dir=str(tmp_path))
    seen: list[list[int]] = []
    try:
        group.start(time.time(), tick=lambda: seen.append(sorted(group.ranks)))
        assert seen == [[4], [4, 5], [4, 5, 6]]
        assert sorted(group.ranks) == [4, 5, 6, 7]
    finally:
        group.stop(2.0)
        tee.close()
    group.poll(time.time())
    assert all(r.exitcode is not None for r in group.ranks.values())
