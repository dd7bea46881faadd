"""Worker messages read late, in one batch, keep the times they were sent (real processes)."""

from __future__ import annotations

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

SPEC = GroupSpec(attempt=0, restart_count=0, rank_offset=0, world_size=1, node_rank=0, nnodes=1,
                 local_world_sizes=(1,), master_addr="127.0.0.1", master_port=1, restore_step=None, inject="")


def test_steps_read_in_one_batch_are_timed_by_their_stamps(tmp_path: Path) -> None:
    # The agent reads worker messages at most every MESSAGES_EVERY_S (agent/pace.py): step
    # times measured from when they were read would be ~0 for all but the first of a batch.
    tee = ConsoleTee()
    group = WorkerGroup(SPEC, cmd=[sys.executable, "-c", "import time; time.sleep(60)"], env_for=lambda *_: {},
                        run_logs=RunLogDir(LogSpec(log_dir=str(tmp_path)), "j"), tee=tee, host="h",
                        hang=HangDetector(), role="default", stack_dir=str(tmp_path))
    group.start(time.time() - 5.0)  # started 5 s ago, by both clocks: the stamps below are of this attempt
    group.hang.start(time.monotonic() - 5.0, list(group.ranks))
    try:
        now = time.time()
        sent = [now - 2.0 + 0.25 * i for i in range(8)]  # a step every 0.25 s, the last 0.25 s ago
        for step, ts in enumerate(sent, start=1):
            group.on_message({"t": "step", "rank": 0, "step": step, "ts": ts}, now)
        rank = group.ranks[0]
        assert rank.step == 8 and rank.last_step_at == sent[-1]
        assert all(abs(t - 0.25) < 1e-6 for t in rank.iter_times), list(rank.iter_times)
        median = group.hang.stats.median(0)
        assert median is not None and abs(median - 0.25) < 1e-3
        stepped = group.last_step_at()
        assert stepped is not None and abs((time.monotonic() - stepped) - (time.time() - sent[-1])) < 0.05
        # A stamp from the future (another clock) counts as read now, never later.
        group.on_message({"t": "step", "rank": 0, "step": 9, "ts": time.time() + 30}, time.time())
        assert rank.last_step_at is not None and rank.last_step_at <= time.time()
    finally:
        group.stop(2.0)
        tee.close()
    group.poll(time.time())
    assert all(r.exitcode is not None for r in group.ranks.values())


def test_a_destroyed_process_group_stops_hang_calls_until_a_new_step(tmp_path: Path) -> None:
    # ``closed``: the rank destroyed its default process group; no collective can join every
    # rank again, so the idle tail after it is not a hang. A later step (a new group) takes it back.
    tee = ConsoleTee()
    group = WorkerGroup(SPEC, cmd=[sys.executable, "-c", "import time; time.sleep(60)"], env_for=lambda *_: {},
                        run_logs=RunLogDir(LogSpec(log_dir=str(tmp_path)), "j"), tee=tee, host="h",
                        hang=HangDetector(), role="default", stack_dir=str(tmp_path))
    group.start(time.time() - 5.0)
    try:
        now = time.time()
        group.on_message({"t": "step", "rank": 0, "step": 1, "ts": now - 1}, now)
        assert group.next_check_s(time.monotonic()) != float("inf")
        group.on_message({"t": "closed", "rank": 0, "ts": now}, now)
        assert group.next_check_s(time.monotonic()) == float("inf")
        group.on_message({"t": "step", "rank": 0, "step": 2, "ts": now + 0.01}, now + 0.01)
        assert group.next_check_s(time.monotonic()) != float("inf")
        group.on_message({"t": "closed", "rank": 0, "ts": now + 0.02}, now + 0.02)
        group.on_message({"t": "opened", "rank": 0, "ts": now + 0.03}, now + 0.03)  # a new group is made
        assert group.next_check_s(time.monotonic()) != float("inf")
    finally:
        group.stop(2.0)
        tee.close()
    group.poll(time.time())


def test_a_rank_that_execs_or_never_initialises_distributed_has_unknown_progress(tmp_path: Path) -> None:
    """A rank that replaced its image (``exec``) lost its hooks: no step reports, no stack-dump
    handler; one that said hello but never initialised torch.distributed for NEVER_READY_S runs
    its trainer in a child process (a per-rank wrapper). Either way its failure is not "before
    its first step", which the crash-loop guard and the user-error rules would act on."""
    from unicron.agent.progress import NEVER_READY_S

    group, tee = sleeping_group(tmp_path, 2, sleep_s=60)
    start = time.time() - 100.0
    group.start(start)
    try:
        for rank in (0, 1):
            group.on_message({"t": "hello", "rank": rank, "ts": start + 1}, start + 1)
        group.on_message({"t": "exec", "rank": 0, "ts": start + 2}, start + 2)
        execd, wrapper = group.ranks[0], group.ranks[1]
        assert not execd.hooked and wrapper.hooked
        assert group.steps_completed(execd, start + 3) is None  # at once: the hooks are gone
        assert group.steps_completed(wrapper, start + 1 + NEVER_READY_S - 1) == 0  # still starting up
        assert group.steps_completed(wrapper, start + 1 + NEVER_READY_S + 1) is None
        assert group.progress(start + 3) is None
        # One that called init_process_group and never got out (a peer it cannot reach) is still
        # starting up, however long that takes: failing there again is a node's fault.
        group.on_message({"t": "init", "rank": 1, "ts": start + 2}, start + 2)
        assert group.steps_completed(wrapper, start + 1 + NEVER_READY_S + 50) == 0
    finally:
        group.stop(2.0)
        tee.close()
    group.poll(time.time())


def test_a_rank_that_raised_is_shown_failed_before_it_is_reaped(tmp_path: Path) -> None:
    """Acceptance 26A F5: during the stop that waits for it to exit, status showed it running."""
    group, tee = sleeping_group(tmp_path, 2)
    group.start(time.time())
    try:
        group.on_message({"t": "hello", "rank": 1, "ts": time.time()}, time.time())
        group.on_message({"t": "exc", "rank": 1, "type": "ValueError", "msg": "bad", "tb": "", "ts": time.time()},
                         time.time())
        assert [w["state"] for w in group.summary()] == ["running", "failed"]
    finally:
        group.stop(2.0)
        tee.close()
