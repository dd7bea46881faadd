"""End to end: torchrun scripts unicron cannot count steps in (a loop without ``torch.optim``)
and ranks that end on their own, failing for real. What a torchrun user expects: a failure in
the middle of such a run is retried (its progress is unknown, not zero), the rank that exited
is blamed rather than the peer that saw its socket close, and a rank that finishes early is
not waited for."""

from __future__ import annotations

import pytest
from e2e import read_events, run_unicron

pytestmark = pytest.mark.slow

COMMON = ["--standalone", "--nproc-per-node", "2", "--grace-period", "2", "--first-step-timeout", "60"]

# A torchrun-style loop: manual SGD under no_grad, an all-reduce per iteration, no optimizer,
# no unicron API. ``FAIL`` (python source, evaluated at the end of iteration ``it``) decides
# whether this rank fails there, and how (``restart``: TORCHELASTIC_RESTART_COUNT). ``trained``
# is true once the rank has trained for 1.5 s more than twice its start-up (process start to
# init_process_group done): long past it, whatever this machine's speed.
MANUAL_LOOP = """
import os, signal, sys, time
import psutil
import torch
import torch.distributed as dist

ITERS = int(sys.argv[1])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
joined = time.time()
startup = joined - psutil.Process().create_time()
torch.manual_seed(0)
w = torch.randn(8, 1, requires_grad=True)
for it in range(1, ITERS + 1):
    trained = time.time() - joined > 2 * startup + 1.5
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it * 10 + rank))
    ((x @ w) ** 2).mean().backward()
    with torch.no_grad():
        dist.all_reduce(w.grad)
        w -= 0.01 * w.grad
        w.grad.zero_()
    time.sleep(0.05)
{fail}
print(f"rank {{rank}} done restart={{restart}} w={{w.sum().item():.6f}}", flush=True)
dist.destroy_process_group()
"""


# The start of a small DDP script that steps an optimizer (it will report steps).
DDP_SGD = """import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def _run(workdir, fail: str, *flags: str, iters: int = 200) -> tuple[int, str, str, list[dict]]:
    body = "\n".join("    " + line for line in fail.strip().splitlines())
    (workdir / "loop.py").write_text(MANUAL_LOOP.format(fail=body))
    code, out, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), *flags,
                                  str(workdir / "loop.py"), str(iters)], workdir, timeout=100)
    return code, out, err, read_events(workdir / "logs")


def _attempts(events: list[dict]) -> int:
    return sum(1 for e in events if e["kind"] == "attempt_start")


def test_lazy_import_failing_once_mid_run_is_restarted(workdir) -> None:
    # Long past init_process_group, rank 1 imports a module that is not there, on the first
    # attempt only (a flaky file system): restarted, not a FATAL user error.
    code, out, err, events = _run(workdir, """
if rank == 1 and trained and restart == 0:
    import no_such_plugin_xyz
""", "--max-restarts", "2")
    assert code == 0, err
    assert _attempts(events) == 2
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["action"] == "restart" and decision["rule"] == "user-error-unknown-progress", decision
    assert "rank 0 done restart=1" in out and "rank 1 done restart=1" in out


@pytest.mark.parametrize("who", ["rank == 1", "True"])
def test_lazy_import_failing_every_time_stops_after_one_restart(workdir, who) -> None:
    # On every rank (``True``) the root cause is whichever rank is seen first: the repeat is
    # still the same error.
    code, out, err, events = _run(workdir, f"""
if {who} and trained:
    import no_such_plugin_xyz
""", "--max-restarts", "5")
    assert code != 0
    assert "came back after a restart" in err and "no_such_plugin_xyz" in err
    assert _attempts(events) == 2  # restarted once, never again


def test_killed_twice_mid_run_uses_the_restart_budget_like_torchrun(workdir) -> None:
    # No step reports, but each attempt trained for seconds before the kill: that is not a
    # crash loop, and the second kill is not "failing again without progress".
    code, out, err, events = _run(workdir, """
if rank == 1 and trained and restart < 2:
    os.kill(os.getpid(), signal.SIGKILL)
""", "--max-restarts", "3")
    assert code == 0, err
    assert _attempts(events) == 3
    assert [e["rule"] for e in events if e["kind"] == "decision"] == ["sigkill", "sigkill"]


def test_the_same_transient_error_twice_mid_run_uses_the_restart_budget_like_torchrun(workdir) -> None:
    # Acceptance 21A F3: the same exception word for word after an attempt of unknown progress
    # stopped the job after one restart. These attempts trained for seconds past
    # init_process_group: a transient error met twice is restarted, as under torchrun.
    code, out, err, events = _run(workdir, """
if rank == 1 and trained and restart < 2:
    raise OSError(116, "Stale file handle")
""", "--max-restarts", "3")
    assert code == 0, err
    assert _attempts(events) == 3
    assert "rank 0 done restart=2" in out


def test_rank_calling_sys_exit_is_the_root_cause_not_its_peer(workdir) -> None:
    # Rank 1 leaves with sys.exit(3) while rank 0 waits in the next all-reduce: rank 0's gloo
    # error ("Connection closed by peer") may reach the agent before rank 1 can be reaped.
    code, out, err, events = _run(workdir, """
if rank == 1 and it == 10:
    sys.exit(3)
""", "--max-restarts", "0")
    assert code != 0
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["rule"] == "nonzero-exit", decision
    assert "rank 1" in decision["reason"] and "exited with code 3" in decision["reason"], decision


def test_optimizer_script_failing_late_in_its_start_up_is_still_before_its_first_step(workdir) -> None:
    # A long start-up after init_process_group (model build, data loading, compilation), then a
    # NameError in the first forward: the script built an optimizer, so it will report steps,
    # and it has not: a user error before the first step, not restarted.
    (workdir / "slow_start.py").write_text("""
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
time.sleep(4)  # longer than ``ran_past_startup`` asks of a script without steps
loss = model(torch.ones(2, 4)).sum() * learning_rate_typo
""")
    code, out, err = run_unicron(["run", *COMMON, "--max-restarts", "3", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "slow_start.py")], workdir, timeout=100)
    assert code != 0
    assert "user error" in err and "learning_rate_typo" in err
    assert _attempts(read_events(workdir / "logs")) == 1


def test_a_rank_stuck_before_the_first_step_of_the_first_attempt_is_a_hang(workdir) -> None:
    # Both ranks built their optimizer; rank 1 then stalls in its start-up ("reading the dataset
    # index") while rank 0 waits in a broadcast. The first-step allowance (4 s here) applies in
    # the first attempt too: the hang is called, rank 1 named, and the restart trains to the end.
    (workdir / "stuck_start.py").write_text(DDP_SGD + """if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(3600)
index = torch.zeros(1)
dist.broadcast(index, 0)
for _ in range(5):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
print(f"rank {rank} done", flush=True)
""")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--grace-period", "2",
                                  "--first-step-timeout", "4", "--max-restarts", "1", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "stuck_start.py")], workdir, timeout=100)
    assert code == 0, err
    events = read_events(workdir / "logs")
    hang = next(e for e in events if e["kind"] == "fault")
    assert hang["fault_kind"] == "hang", hang
    assert next(e for e in events if e["kind"] == "decision")["culprits"] == [1]
    assert "rank 0 done" in out and "rank 1 done" in out


def test_a_scripts_own_sigusr1_handler_is_left_alone_by_the_hang_diagnosis(workdir) -> None:
    # The usual Slurm/Lightning "checkpoint and requeue" handler on SIGUSR1. The stacks of a hang
    # are asked for with another signal: the handler never runs, and the culprit is named.
    (workdir / "usr1.py").write_text("""
import os, signal, sys, time
import torch
import torch.distributed as dist

def requeue(signum, frame):
    open(sys.argv[1] + f".rank{rank}", "w").write("requeue")

dist.init_process_group("gloo")
rank = dist.get_rank()
signal.signal(signal.SIGUSR1, requeue)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    if rank == 1 and step == 4 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        time.sleep(3600)
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.05)
""")
    marker = workdir / "requeued"
    code, out, err = run_unicron(["run", *COMMON, "--max-restarts", "1", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "usr1.py"), str(marker)], workdir, timeout=100)
    assert code == 0, err
    assert not list(workdir.glob("requeued.*")), "the script's SIGUSR1 handler ran"
    events = read_events(workdir / "logs")
    assert next(e for e in events if e["kind"] == "fault")["fault_kind"] == "hang"
    assert next(e for e in events if e["kind"] == "decision")["culprits"] == [1]


def test_rank_finishing_early_is_not_waited_for(workdir) -> None:
    # Rank 1 finishes after 10 steps and exits 0; rank 0 goes on alone for 60 more optimizer
    # steps (~3 s, twice the idle hang threshold): torchrun runs this to the end, so must we.
    (workdir / "uneven.py").write_text(DDP_SGD + """for _ in range(10):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    probe = model.module
    for _ in range(60):
        opt.zero_grad()
        probe(torch.ones(2, 4)).sum().backward()
        opt.step()
        time.sleep(0.05)
print(f"rank {rank} finished", flush=True)
""")
    _ends_cleanly_without_a_fault(workdir, "uneven.py")



UNEVEN_END = """
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step(collective=True):
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    if collective:
        for p in model.parameters():
            dist.all_reduce(p.grad)
    opt.step()
    time.sleep(0.05)


for _ in range(20):
    step()
if rank == 0:  # trains on alone for 4 s (more data on this rank) ...
    start = time.time()
    while time.time() - start < 4:
        step(collective=False)
dist.barrier()  # ... while rank 1 waits here, past the idle threshold
print(f"rank {rank} finished", flush=True)
"""


def test_a_rank_waiting_at_the_end_for_one_that_trains_on_alone_is_not_hung(workdir) -> None:
    # Rank 0 keeps completing optimizer steps: the job makes progress, as torchrun lets it.
    # It used to be called a hang 1.5 s after rank 1's last step, rank 0 named the culprit.
    (workdir / "uneven_end.py").write_text(UNEVEN_END)
    _ends_cleanly_without_a_fault(workdir, "uneven_end.py")

# 30 steps of a tiny data-parallel training, then the TAIL under test.
TRAINED_THEN = """
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(30):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
TAIL
print(f"rank {rank} finished", flush=True)
"""


def test_an_idle_tail_after_a_peer_finished_is_not_a_hang(workdir) -> None:
    # After the last step rank 1 exits 0 while rank 0 waits idle for 4 s (an upload,
    # wandb.finish()): past the idle hang threshold (1.5 s), but the job is past its last step.
    (workdir / "tail.py").write_text(TRAINED_THEN.replace("TAIL", "if rank == 0:\n    time.sleep(4)"))
    _ends_cleanly_without_a_fault(workdir, "tail.py")


@pytest.mark.parametrize("destroy", ["dist.destroy_process_group()",
                                     "from torch.distributed import destroy_process_group as d\nd()"],
                         ids=["attribute", "imported"])
def test_an_idle_tail_after_destroy_process_group_is_not_a_hang(workdir, destroy: str) -> None:
    # After the last step every rank destroys the process group, then waits idle for 4 s (an
    # upload on each rank): no rank finished yet, but no collective can come any more.
    (workdir / "tail.py").write_text(TRAINED_THEN.replace("TAIL", destroy + "\ntime.sleep(4)"))
    _ends_cleanly_without_a_fault(workdir, "tail.py")


def test_a_hang_after_the_process_group_is_made_again_is_found(workdir) -> None:
    # destroy_process_group() then init_process_group(): the script goes on with collectives,
    # and rank 1 then stalls while rank 0 waits in an all_reduce: a hang, as without the destroy.
    # (A store of its own: the env:// one still holds the first group's keys, which gloo reads.)
    store = workdir / "second-store"
    again = ("dist.destroy_process_group()\n"
             f"dist.init_process_group('gloo', init_method='file://{store}', rank=rank, world_size=2)\n"
             "if rank == 1:\n    time.sleep(1000)\ndist.all_reduce(torch.ones(1))")
    (workdir / "again.py").write_text(TRAINED_THEN.replace("TAIL", again))
    code, _, err = run_unicron(["run", *COMMON, "--max-restarts", "0", "--log-dir", str(workdir / "logs"),
                                str(workdir / "again.py")], workdir, timeout=100)
    assert code != 0 and "hang" in err, err
    hangs = [e for e in read_events(workdir / "logs") if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hangs, err


def _ends_cleanly_without_a_fault(workdir, script: str) -> None:
    code, out, err = run_unicron(["run", *COMMON, "--max-restarts", "0", "--log-dir", str(workdir / "logs"),
                                  str(workdir / script)], workdir, timeout=100)
    assert code == 0, err
    assert "rank 0 finished" in out and "rank 1 finished" in out
    assert not [e for e in read_events(workdir / "logs") if e["kind"] == "fault"]


def test_a_rank_that_never_steps_stalling_mid_run_is_found_in_seconds_and_named(workdir) -> None:
    # Learner/actor: ranks 0 and 1 train (DDP over their own group), rank 2 never builds an
    # optimizer and only runs the policy with the weights rank 0 broadcasts. The actor stalls for
    # good at iteration 40 of the first attempt. The first-step timeout (the default 300 s) must
    # not apply to the whole job because one rank never steps: the learners stop stepping, the
    # hang is called at the idle threshold, and the actor is the culprit.
    (workdir / "actor.py").write_text("""import os, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
learners = dist.new_group([0, 1])
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
if rank < 2:
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=learners)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
for it in range(80):
    if rank < 2:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(it * 10 + rank))
        opt.zero_grad()
        (ddp(x) - x).pow(2).mean().backward()
        opt.step()
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    if rank == 2:
        with torch.no_grad():
            model(torch.randn(16, 8)).sum().item()
        if it == 40 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            time.sleep(3600)
    time.sleep(0.02)
print(f"rank {rank} done", flush=True)
""")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "3", "--grace-period", "2",
                                  "--max-restarts", "1", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "actor.py")], workdir, timeout=100)
    assert code == 0, err
    assert all(f"rank {r} done" in out for r in range(3)), out
    events = read_events(workdir / "logs")
    hang = next(e for e in events if e["kind"] == "fault")
    assert hang["fault_kind"] == "hang" and "before its first step" not in hang["message"], hang
    assert hang["latency_s"] < 60, hang  # the idle threshold, not the 300 s first-step timeout
    assert next(e for e in events if e["kind"] == "decision")["culprits"] == [2]


def test_objects_left_out_of_the_state_are_warned_of_once_under_unicron(workdir) -> None:
    # README's shortest example passes a model and an optimizer: a scheduler and a second
    # optimizer left out would silently start again after a restore. Rank 0 says so, once.
    (workdir / "leftout.py").write_text("""import torch, torch.distributed as dist
import unicron

dist.init_process_group("gloo")
model, head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
critic = torch.optim.Adam(head.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
state = unicron.State(model=model, optimizer=opt)
for step in range(state.restore(), 4):
    dist.barrier()  # in step: rank 0 does not finish before rank 1's injected kill stops it
    for o, m in ((opt, model), (critic, head)):
        o.zero_grad()
        m(torch.ones(2, 4)).sum().backward()
        o.step()
    sched.step()
    state.commit(step + 1)
print(f"rank {dist.get_rank()} done", flush=True)
""")
    # Once per job, not once per attempt (31A F5): the restored attempt does not say it again.
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "logs"),
                                  "--max-restarts", "1", "--inject", "kill@1:2", str(workdir / "leftout.py")],
                                 workdir, timeout=100)
    assert code == 0, err
    assert "restoring step" in err, err
    assert err.count("an LR scheduler of 'optimizer' is not in this unicron.State") == 1, err
    assert err.count("an optimizer (Adam) that has stepped is not in this unicron.State") == 1, err


def test_a_rank_that_execs_itself_and_fails_mid_run_is_restarted_like_under_torchrun(workdir) -> None:
    # A per-rank launcher pattern: set something that must be in place before the interpreter
    # starts, then exec Python again on the same script. The new image has none of unicron's
    # hooks, so its steps are unknown: a failure after a while of work is not "before its first
    # step", and --max-restarts is honoured as under torchrun (once taken for a crash loop: exit 1).
    (workdir / "reexec.py").write_text("""
import os, sys, time
if os.environ.get("REEXECED") != "1":
    os.environ["REEXECED"] = "1"
    os.execv(sys.executable, [sys.executable, "-u", *sys.argv])
time.sleep(0.5)  # work
if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 2:
    raise RuntimeError("late failure")
print(f"rank {os.environ['RANK']} done", flush=True)
""")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "3",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "reexec.py")], workdir, timeout=150)
    assert code == 0, err
    assert "rank 0 done" in out
    assert _attempts(read_events(workdir / "logs")) == 3
    assert "before its first step" not in err, err


def test_a_working_directory_file_named_like_a_module_torch_imports_breaks_no_rank(workdir) -> None:
    # A project root holding its data-prep script as tokenize.py, the training script under
    # scripts/: torchrun's `python scripts/train.py` never looks in the working directory; the
    # zygote and the cold boot (both `python -m`) once imported it in place of the stdlib's.
    (workdir / "tokenize.py").write_text("raise SystemExit('the project tokenize.py was imported')\n")
    (workdir / "scripts").mkdir()
    (workdir / "scripts" / "train.py").write_text("""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(2)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.tolist()}", flush=True)
dist.destroy_process_group()
""")
    import subprocess
    import sys
    from pathlib import Path

    from e2e import clean_env

    # The installed command, as users run it (`python -m unicron` would put the directory first itself).
    command = str(Path(sys.executable).parent / "unicron")
    for warm in ([], ["--no-warm"]):
        done = subprocess.run([command, "run", "--standalone", "--nproc-per-node", "1", *warm, "scripts/train.py"],
                              cwd=workdir, env=clean_env(),
                              capture_output=True, text=True, timeout=120)
        code, out, err = done.returncode, done.stdout, done.stderr
        assert code == 0, err
        assert "project tokenize.py" not in err and "rank 0 sum [1.0, 1.0]" in out, out + err


def test_a_python_exec_without_unicron_runs_its_workers_as_torchrun_would(workdir) -> None:
    # PYTHON_EXEC naming another environment's interpreter (here: this one without its site
    # packages, so no unicron): its workers start as under torchrun, said once; --inject, which
    # needs the hooks, is refused in one line. Every rank once failed to start instead.
    import stat
    import subprocess
    import sys

    from e2e import clean_env

    python = workdir / "other-python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    # One string: unbuffered (PYTHONUNBUFFERED), print writes each argument apart, and the two
    # ranks' words interleaved on the shared console ("rankrank 1 of 2\n 0 of 2").
    (workdir / "plain.py").write_text("import os\nprint(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\")\n")
    env = clean_env(PYTHON_EXEC=str(python))
    env.pop("PYTHONPATH", None)
    premise = subprocess.run([str(python), "-c", "import unicron"], cwd=workdir, env=env, capture_output=True)
    assert premise.returncode != 0  # it has no unicron
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "plain.py"], workdir, env=env)
    assert code == 0, err
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    assert "cannot import unicron's worker hooks" in err and "as with --no-inject" in err, err
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--inject", "kill@0:1", "plain.py"],
                                 workdir, env=env)
    assert code == 2 and err.strip().count("\n") == 0 and "--inject needs unicron's worker hooks" in err, err
