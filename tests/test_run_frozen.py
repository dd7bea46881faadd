"""End to end: a rank frozen past its last collective (``unicron.agent.frozen``).

torch's teardown can deadlock: the main thread frees a DDP reducer after
``destroy_process_group`` and, holding the interpreter lock, joins gloo's work thread, which
waits for that lock (acceptance 31A F1: the job had trained, its other rank exited 0, and the
launcher waited for ever, as torchrun does). The scripts here make the same deadlock for real:
a native call that holds the interpreter lock and blocks for good (a mutex locked twice
through ``ctypes.PyDLL``, which does not release the lock)."""

from __future__ import annotations

import signal
import time

import pytest
from e2e import Launched, read_events, run_unicron, wait_for

pytestmark = pytest.mark.slow

SCRIPT = """import ctypes, os, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.ones(1)
dist.all_reduce(total)
dist.destroy_process_group()
if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    TAIL
print(f"rank {rank} done, restart {os.environ['TORCHELASTIC_RESTART_COUNT']}, sum {total.item():g}", flush=True)
"""

DEADLOCK = """libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroed: an unlocked default pthread mutex
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)  # holds the interpreter lock, blocked for good"""

FLAGS = ["--standalone", "--nproc-per-node", "2", "--grace-period", "2", "--hang-busy-floor", "2"]


@pytest.mark.timeout(150)
def test_a_rank_deadlocked_holding_the_interpreter_lock_after_its_last_collective_is_killed_and_healed(workdir) -> None:
    (workdir / "frozen.py").write_text(SCRIPT.replace("TAIL", DEADLOCK))
    code, out, err = run_unicron(["run", *FLAGS, "--max-restarts", "1", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "frozen.py")], workdir, timeout=120)
    assert code == 0, err
    assert "rank 0 done, restart 1, sum 2" in out and "rank 1 done, restart 1, sum 2" in out, out
    assert "rank 1 (pid" in err and "froze after it destroyed its process group" in err, err
    events = read_events(workdir / "logs")
    frozen = [e for e in events if e["kind"] == "worker_frozen"]
    assert [e["rank"] for e in frozen] == [1] and frozen[0]["silent_s"] >= 3 * 2, frozen
    decisions = [e for e in events if e["kind"] == "decision"]
    assert len(decisions) == 1 and decisions[0]["action"] == "restart", decisions
    assert "froze past its last collective and was killed by unicron" in decisions[0]["reason"], decisions
    # Its stack was taken before the kill (the dump needs no interpreter lock): the native call.
    stacks = list((workdir / "logs").rglob("stacks/rank1.txt"))
    assert stacks and "frozen.py" in stacks[0].read_text(), stacks


@pytest.mark.timeout(150)
def test_a_rank_that_waits_without_the_interpreter_lock_after_its_last_collective_is_left_alone(workdir) -> None:
    """A tail that waits (an upload, a sleep) lets the lock go: its liveness thread says ``alive``,
    and it is waited for however long, as under torchrun."""
    (workdir / "tail.py").write_text(SCRIPT.replace("TAIL", "time.sleep(3 * 2 + 3)"))
    code, out, err = run_unicron(["run", *FLAGS, "--max-restarts", "1", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "tail.py")], workdir, timeout=120)
    assert code == 0, err
    assert "rank 1 done, restart 0, sum 2" in out, out
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("worker_frozen", "fault", "decision")], err


@pytest.mark.timeout(150)
def test_a_launcher_paused_while_a_rank_sleeps_past_its_end_does_not_call_the_rank_frozen(workdir) -> None:
    """The launcher itself was stopped (SIGSTOP, a VM pause) for longer than the frozen limit
    while rank 1 slept past its end (acceptance 32A F3): its ``alive`` ticks waited unread in the
    channel, so the silence was the agent's, not the rank's; the job ends as it would have."""
    marker = workdir / "tail_started"
    tail = f"open({str(marker)!r}, 'w').close()\n    time.sleep(3 * 2 + 10)"
    (workdir / "tail.py").write_text(SCRIPT.replace("TAIL", tail))
    job = Launched(["run", *FLAGS, "--max-restarts", "1", "--log-dir", str(workdir / "logs"), str(workdir / "tail.py")],
                   workdir)
    try:
        wait_for(marker.exists, 60, "rank 1's tail to start")
        job.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(10)  # the pause is the fault: 10 s > 3 x --hang-busy-floor 2
        finally:
            job.proc.send_signal(signal.SIGCONT)
        code, out, err = job.wait(90)
    finally:
        job.kill()
    assert code == 0, err
    assert "rank 1 done, restart 0, sum 2" in out, out
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("worker_frozen", "fault", "decision")], err
    assert [e for e in events if e["kind"] == "agent_paused"], "the agent did not see its own pause"
