"""A rank that breaks its peers' connections before its own exception reaches Python (as gloo
does on its way to throwing) is still the root cause: the stop waits for it, not killing it
while its victims' reports arrive first."""

from __future__ import annotations

import re
import signal

import psutil
import pytest
from e2e import read_events, run_unicron, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = r"""
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
marker = sys.argv[1]
for step in range(20):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    if first and step == 5 and dist.get_rank() == 1:
        # What native code does on its way to an exception: log the error, tear the connections
        # down (rank 0 fails on that at once: below), and only then throw.
        sys.stderr.write("[E1206 08:22:42.078670627 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed\n")
        sys.stderr.flush()
        open(marker, "w").close()
        time.sleep(0.6)
        raise RuntimeError("Gloo connectFullMesh failed: timed out connecting to rank 0")
    if first and step == 5 and dist.get_rank() == 0:
        while not os.path.exists(marker):
            time.sleep(0.001)
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:40123")
dist.destroy_process_group()
"""


def test_a_rank_that_breaks_its_peers_before_it_throws_is_the_root_cause(workdir) -> None:
    (workdir / "tears_down.py").write_text(SCRIPT)
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                   "--log-dir", str(workdir / "logs"), str(workdir / "tears_down.py"),
                                   str(workdir / "torn")],
                                  workdir, timeout=150)
    assert code == 0, err
    decisions = [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    assert len(decisions) == 1, decisions
    reason = decisions[0]["reason"]
    assert "rank 1" in reason and "timed out connecting to rank 0" in reason, reason
    assert decisions[0]["rule"] != "peer-connection-lost", decisions[0]


FINALLY_DESTROY = r"""
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for step in range(40):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if step == 5 and dist.get_rank() == 1:
            raise KeyError("missing_key_in_batch")
finally:
    dist.destroy_process_group()  # PyTorch's own advice: the peers' collectives fail on it at once
"""


def test_a_rank_that_raises_through_a_finally_that_destroys_its_group_is_the_root_cause(workdir) -> None:
    """Acceptance 25A F1: the ``closed`` the ``finally`` sends came before the exception's
    report, so the raising rank counted as ended cleanly ("exited with code 0") and the job
    was stopped for an uneven end, KeyError nowhere. 28A F2: with every rank raising, and a
    cleanup longer than the hang floor after the destroy, a hang was called on the cleanup."""
    (workdir / "finally_destroy.py").write_text(FINALLY_DESTROY)
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                   "--log-dir", str(workdir / "logs"), str(workdir / "finally_destroy.py")],
                                  workdir, timeout=150)
    assert code == 1, err
    assert "unicron: error: rank 1 on" in err and "raised KeyError: 'missing_key_in_batch'" in err, err
    assert "exited with code 0" not in err, err
    (workdir / "all_raise.py").write_text(FINALLY_DESTROY.replace(' and dist.get_rank() == 1', '').replace(
        "    dist.destroy_process_group()  # PyTorch's own advice: the peers' collectives fail on it at once",
        "    dist.destroy_process_group()\n    time.sleep(4)  # an upload after it"))
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                   str(workdir / "all_raise.py")], workdir, timeout=150)
    assert code == 1 and "raised KeyError: 'missing_key_in_batch'" in err.split("unicron: error: ")[1], err
    assert "hang" not in err, err


CAUGHT_DESTROY = r"""
import sys
import torch
import torch.distributed as dist


class EarlyStop(Exception):
    pass


dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    for step in range(40):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        if step == 5:  # every rank: the loss converged
            raise EarlyStop(f"converged at step {step}")
except EarlyStop as e:
    print(f"rank {dist.get_rank()}: {e}; cleaning up", flush=True)
    dist.destroy_process_group()  # with the exception in hand, though caught
    rank = __import__("os").environ["RANK"]
    if sys.argv[1:] == ["fail"] and rank == "1":
        sys.exit(3)  # the except block ends the rank after all
    if sys.argv[1:] == ["idle"]:
        __import__("time").sleep(4)  # an upload, wandb.finish(): longer than the hang floor
    if sys.argv[1:] == ["killed"] and rank == "1":
        __import__("os").kill(__import__("os").getpid(), 9)  # the OOM killer, in the cleanup
print("exiting normally", flush=True)
"""


def test_an_exception_caught_in_an_except_that_destroys_the_group_is_no_failure(workdir) -> None:
    """Acceptance 27A F1: ``except EarlyStop: destroy_process_group()`` (the exception caught,
    every rank exiting 0) was reported as rank 1's failure and restarted until the budget was
    spent: the destroy's report of the exception in hand cannot tell an ``except`` from a
    ``finally``. The rank's exit decides; and an ``except`` that exits non-zero still fails."""
    (workdir / "caught_destroy.py").write_text(CAUGHT_DESTROY)
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                                  str(workdir / "caught_destroy.py")], workdir, timeout=150)
    assert code == 0, err
    assert out.count("exiting normally") == 2, out
    assert "EarlyStop" not in err and "restart" not in err, err
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                  str(workdir / "caught_destroy.py"), "fail"], workdir, timeout=150)
    assert code == 1, err
    assert "unicron: error: rank 1 on" in err and "exited with code 3" in err.split("unicron: error: ")[1], err
    assert "EarlyStop" not in err, err  # caught: the sys.exit that followed is the cause
    # 28A F1: an idle cleanup after the caught exception was called a hang (no verdict while an
    # exception in hand is undecided); 28A F3: a SIGKILL in it was blamed on the caught exception.
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                  str(workdir / "caught_destroy.py"), "idle"], workdir, timeout=150)
    assert code == 0 and out.count("exiting normally") == 2 and "hang" not in err, err
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                  str(workdir / "caught_destroy.py"), "killed"], workdir, timeout=150)
    assert code == 1 and "unicron: error: rank 1 on" in err, err
    assert "killed by SIGKILL" in err.split("unicron: error: ")[1] and "EarlyStop" not in err, err


THREAD_THEN_KILL = r"""
import os, signal, threading
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"

def upload():  # a metrics uploader whose endpoint resets the connection; training goes on
    raise ConnectionResetError(104, "Connection reset by peer")

for step in range(12):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    if first and dist.get_rank() == 1 and step == 2:
        t = threading.Thread(target=upload, name="uploader")
        t.start()
        t.join()
    if first and dist.get_rank() == 1 and step == 8:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, a preemption
dist.destroy_process_group()
"""


def test_a_background_threads_old_exception_does_not_explain_a_later_sigkill(workdir) -> None:
    (workdir / "thread_then_kill.py").write_text(THREAD_THEN_KILL)
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                   "--log-dir", str(workdir / "logs"), str(workdir / "thread_then_kill.py")],
                                  workdir, timeout=150)
    assert code == 0, err
    decisions = [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    assert len(decisions) == 1 and decisions[0]["rule"] == "sigkill", decisions
    assert "ConnectionResetError" not in decisions[0]["reason"], decisions[0]
    said = next(line for line in err.splitlines() if "exit on rank 1" in line)
    assert said.rstrip().endswith("signal SIGKILL (9)"), said


HIDDEN_ABORT = r"""
import os, sys, time
if os.environ["LOCAL_RANK"] == "0":
    sys.stderr.write("terminate called after throwing an instance of 'c10::Error'\n"
                     "  what():  CUDA error: an illegal memory access was encountered\n")
    sys.stderr.flush()
    os.abort()
time.sleep(30)
"""


def test_a_rank_hidden_by_local_ranks_filter_keeps_its_stderr_for_the_classifier(workdir) -> None:
    """``--local-ranks-filter 1`` hides rank 0 from the console, not from the failure report."""
    (workdir / "hidden.py").write_text(HIDDEN_ABORT)
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--local-ranks-filter", "1",
                                   "--log-dir", str(workdir / "logs"), str(workdir / "hidden.py")], workdir, timeout=90)
    assert code == 1, err
    decision = next(e for e in read_events(workdir / "logs") if e["kind"] == "decision")
    assert decision["rule"] == "cuda-error" and "illegal memory access" in decision["reason"], decision
    assert list((workdir / "logs").rglob("0/stderr.log")), "rank 0's stderr.log"


SIGTERM_KEEPER = r"""
import atexit, os, signal, sys, time
ready = sys.argv[1]
if os.environ["RANK"] == "1":  # as Lightning: a handler that notes SIGTERM, and goes on
    signal.signal(signal.SIGTERM, lambda *_: print("rank 1 got SIGTERM, goes on", file=sys.stderr, flush=True))
    open(ready, "w").close()
    while True:
        time.sleep(0.05)
deadline = time.monotonic() + 60
while not os.path.exists(ready) and time.monotonic() < deadline:
    time.sleep(0.01)
# Rank 0 fails, and its teardown takes a while (an atexit hook): it is on its way out, and its
# SIGTERM handler must not run in the middle of that (acceptance 23C F1; torchrun never signals it).
signal.signal(signal.SIGTERM, lambda *_: print("rank 0 got SIGTERM in its teardown", file=sys.stderr, flush=True))
atexit.register(time.sleep, 0.5)
raise RuntimeError("rank 0 fails")
"""


def test_a_stop_is_said_as_it_starts_and_ranks_killed_after_the_grace_period_are_named(workdir) -> None:
    """Acceptance 20A F2: "stopping attempt 0" came a whole grace period late, after the lines of
    ranks that handle SIGTERM themselves (every restart of a Lightning job), and nothing said
    why the stop took that long."""
    (workdir / "keeper.py").write_text(SIGTERM_KEEPER)
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--grace-period", "2",
                                   str(workdir / "keeper.py"), str(workdir / "ready")], workdir, timeout=90)
    assert code == 1, err  # the launcher's, as torchrun's
    lines = err.splitlines()
    stopping = next(i for i, line in enumerate(lines) if "stopping attempt 0" in line)
    noted = next(i for i, line in enumerate(lines) if "rank 1 got SIGTERM" in line)
    # Rank 0's teardown may outlast the grace on a loaded machine: then it is named too ("0, 1").
    killed = next(i for i, line in enumerate(lines) if re.search(
        r"rank\(s\) (0, )?1 did not exit within the 2 s grace period after SIGTERM: killed$", line))
    assert stopping < noted < killed, err
    assert "rank 0 got SIGTERM" not in err and "RuntimeError: rank 0 fails" in err


USR1_CHECKPOINTER = r"""
import os, signal, sys, time
import torch.distributed as dist
ready, out = sys.argv[1], sys.argv[2]
rank = os.environ["RANK"]
asked = []
signal.signal(signal.SIGUSR1, lambda *_: asked.append(1))  # as Lightning does on Slurm's --signal=USR1@90
import unicron
dist.init_process_group("gloo")
open(f"{ready}.{rank}", "w").close()
while not asked:
    unicron.step()
    time.sleep(0.05)
time.sleep(2.5)  # writing the checkpoint (idle: longer than the 1.5 s idle hang floor)
dist.barrier(group=dist.new_group(backend="gloo"))  # a group for it: the store, after the signal
open(f"{out}.{rank}", "w").write("checkpoint")
dist.destroy_process_group()
"""


def test_slurms_usr1_to_every_process_lets_the_workers_handler_finish(workdir, launch) -> None:
    """Acceptance 23B F1: Slurm's --signal=USR1@N signals every process of the step. Its default
    action killed the launcher, and with it the workers in the middle of their checkpoint; nor
    is a handler that holds the ranks between steps a hang. 25A F3: it killed the zygote and
    the store host (a new process group after it failed on the store) and the janitor."""
    (workdir / "usr1.py").write_text(USR1_CHECKPOINTER)
    job = launch(["run", "--standalone", "--nproc-per-node", "2", str(workdir / "usr1.py"),
                  str(workdir / "ready"), str(workdir / "ckpt")], workdir)
    wait_for(lambda: all((workdir / f"ready.{r}").exists() for r in (0, 1)), 60, "both ranks to step")
    wait_for(lambda: len(psutil.Process(job.proc.pid).children(recursive=True)) >= 2, 30, "the workers")
    helpers = {}  # zygote, store host, janitor: process -> its command line
    for proc in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            line = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "unicron.worker.boot" not in line:
            helpers[proc] = line
    assert len(helpers) >= 3, helpers
    for proc in [psutil.Process(job.proc.pid), *psutil.Process(job.proc.pid).children(recursive=True)]:
        try:
            proc.send_signal(signal.SIGUSR1)
        except psutil.NoSuchProcess:
            pass
    wait_for(lambda: all((workdir / f"ckpt.{r}").exists() for r in (0, 1)) or job.proc.poll() is not None, 60,
             "the checkpoints")
    gone = [line for p, line in helpers.items() if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE]
    code, _out, err = job.wait(60)
    assert code == 0, err
    assert all((workdir / f"ckpt.{r}").read_text() == "checkpoint" for r in (0, 1)), err
    assert not gone, gone
    assert "hang on node" not in err and "SIGUSR1 to the launcher: left to the workers" in err, err


@pytest.mark.timeout(120)
def test_a_ranks_traceback_is_on_the_console_before_the_agents_line_about_it(workdir) -> None:
    """Acceptance 34A F5: the worker reported its exception before Python's hook wrote the
    traceback, so 'exception on rank 1' could come first. An exception whose text takes time
    to make (formatted for the report and for the traceback alike) made it so every time."""
    (workdir / "slow.py").write_text(
        "import os, time\n"
        "class SlowError(Exception):\n"
        "    def __str__(self):\n"
        "        time.sleep(0.5)\n"
        "        return 'slow to say'\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise SlowError()\n")
    code, _, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                                str(workdir / "slow.py")], workdir, timeout=90)
    assert code != 0, err
    assert "SlowError: slow to say" in err and "exception on rank 1" in err, err
    assert err.index("SlowError: slow to say") < err.index("exception on rank 1"), err


@pytest.mark.timeout(150)
def test_a_printed_traceback_then_a_transient_sys_exit_before_the_first_step_is_restarted(workdir) -> None:
    """Acceptance 35A F1: an optional import's ImportError, caught and printed with
    ``traceback.print_exc()``, then ``sys.exit(1)`` before any step (a service not ready yet):
    the stderr ended on the printed traceback, so the rank was FATAL "failed to import". Its
    hooks heard the sys.exit: that ended it, and it is restarted as torchrun does."""
    (workdir / "caught.py").write_text(
        "import os, sys, traceback\n"
        "try:\n"
        "    import not_installed_optional_pkg\n"
        "except ImportError:\n"
        "    traceback.print_exc()\n"
        "if os.environ['RANK'] == '1' and os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
        "    sys.exit(1)\n"
        "print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], 'ok', flush=True)\n")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                                  str(workdir / "caught.py")], workdir, timeout=120)
    assert code == 0, err
    assert "SEV2 restart: rank 1" in err and "exited with code 1" in err and "FATAL" not in err, err
    assert out.count("attempt 1 ok") == 2, out
