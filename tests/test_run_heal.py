"""End to end: real `unicron run` jobs with gloo workers, faults injected for real, and the
final model compared bit for bit with a failure-free run."""

from __future__ import annotations

import os

import pytest
from e2e import clean_env, read_events, run_unicron

pytestmark = pytest.mark.slow

# Hang detection runs with its defaults: an idle job is hung after max(3 x median, 1.5 s).
COMMON = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--grace-period", "2",
          "--first-step-timeout", "60"]


def _train(workdir, out: str, *extra: str, steps: int = 12, sleep: float = 0.02,
           script_args: tuple[str, ...] = ()) -> tuple[int, str, str]:
    args = ["run", *COMMON, "--log-dir", str(workdir / "logs"), *extra,
            str(workdir / "train_state.py"), "--steps", str(steps), "--out", str(workdir / out),
            "--sleep", str(sleep), *script_args]
    return run_unicron(args, workdir, timeout=100)


@pytest.fixture(scope="module")
def reference_hash(tmp_path_factory) -> str:
    """The failure-free run every healed run must equal."""
    import shutil

    from e2e import SCRIPTS

    workdir = tmp_path_factory.mktemp("reference")
    shutil.copy(SCRIPTS / "train_state.py", workdir)
    code, out, err = _train(workdir, "ref.txt")
    assert code == 0, err
    return (workdir / "ref.txt").read_text()


@pytest.mark.parametrize("fault", ["kill@1:5", "exception@0:6", "exit=7@1:4"])
def test_fault_heals_and_matches_failure_free_run(workdir, reference_hash, fault) -> None:
    code, out, err = _train(workdir, "healed.txt", "--inject", fault)
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    kinds = [e["kind"] for e in events]
    assert "fault" in kinds and "decision" in kinds
    starts = [e for e in events if e["kind"] == "attempt_start"]
    assert len(starts) == 2
    # The restart resumed from the in-memory snapshot, losing at most the step in flight.
    step = int(fault.split(":")[1])
    assert starts[1]["restore_step"] is not None and step - 1 <= starts[1]["restore_step"] <= step
    assert "starts at step 0 (restart 1)" not in out
    # Every worker, the restarted ones too, was forked by the zygote (torch already imported).
    started = [e for e in events if e["kind"] == "workers_started"]
    assert [e["warm"] for e in started] == [2, 2]


def test_an_exception_with_a_huge_message_ends_the_job_in_a_bounded_line(workdir) -> None:
    """A 5 MB exception message (a repr of a batch, a list of files) used to exceed the mesh's
    message limit: the fault never reached the coordinator and the job waited forever."""
    (workdir / "huge.py").write_text("raise ValueError('bad batch: ' + 'X' * 5_000_000)\n")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "huge.py")], workdir, timeout=60)
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith("unicron:")]
    assert lines[-1].startswith("unicron: error: ") and "ValueError: bad batch: XXX" in lines[-1], lines[-1][:300]
    assert max(len(line) for line in lines) < 1000
    fault = next(e for e in read_events(workdir / "logs") if e["kind"] == "fault")
    assert fault["error_type"] == "ValueError" and "characters left out" in fault["message"]


def test_an_exception_that_cannot_be_printed_is_still_the_root_cause(workdir) -> None:
    """Its ``__str__`` raises: the hook used to fail on it and report its own TypeError."""
    (workdir / "unprintable.py").write_text(
        "class BadBatch(Exception):\n    def __str__(self):\n        raise TypeError('no str')\n\n"
        "raise BadBatch()\n")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "unprintable.py")], workdir, timeout=60)
    assert code == 1
    fault = next(e for e in read_events(workdir / "logs") if e["kind"] == "fault")
    assert fault["error_type"] == "BadBatch" and fault["message"] == "<exception str() failed>", fault


def test_control_characters_of_a_workers_message_are_escaped_in_the_final_error_line(workdir) -> None:
    """unicron's own last line (the one a user reads) must not recolour the terminal, ring its
    bell, or lose what follows a carriage return in the message."""
    (workdir / "ctrl.py").write_text('raise RuntimeError("bad \\x1b[31mred\\x1b[0m \\x07bell\\rafter the CR")\n')
    code, _out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", str(workdir / "ctrl.py")],
                                  workdir, timeout=60)
    assert code == 1
    last = next(line for line in err.splitlines() if line.startswith("unicron: error:"))
    assert "bad \\x1b[31mred\\x1b[0m \\x07bell\\x0dafter the CR" in last, last


def test_garbage_a_worker_writes_on_its_channel_is_survived_and_the_job_heals(workdir) -> None:
    """A script can reach its agent's channel: an ``exc`` with a number for its traceback and a
    dict for its message, JSON nested deeper than Python parses, integers no float holds. They
    used to end the coordinator's thread (the fault's types) and the agent (RecursionError,
    OverflowError); the ``exc`` of the wrong shape then failed the job (27C F4). Each is dropped,
    and the real fault that follows heals."""
    (workdir / "garbage.py").write_text("""
import json, os, sys, time
import zmq
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    push = zmq.Context().socket(zmq.PUSH)
    push.connect(os.environ["UNICRON_AGENT_ADDR"])
    push.send(b"[" * 200000 + b"]" * 200000)
    # Integers past what a float holds, where a time and a step are read (acceptance 21C F1)
    push.send(b'{"t": "moved", "rank": 0, "ts": 1' + b"0" * 400 + b'}')
    push.send(b'{"t": "step", "rank": 0, "step": 1' + b"0" * 400 + b', "ts": 1.0}')
    push.send(json.dumps({"t": "exc", "rank": 0, "type": 5, "msg": {"a": 1}, "tb": 7, "fatal": True,
                          "ts": time.time()}).encode())
    time.sleep(1)  # all of it read (and dropped: 27C F4) before the real fault
    raise RuntimeError("a real fault after the garbage")
dist.barrier()
print(f"rank {dist.get_rank()} done", flush=True)
""")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                                  "--grace-period", "2", "--log-dir", str(workdir / "logs"),
                                  str(workdir / "garbage.py")], workdir, timeout=100)
    assert code == 0, err
    assert "rank 0 done" in out and "rank 1 done" in out
    # A rank's own output may hold a traceback: rank 1, waiting in the barrier, can see rank 0 go
    # before it is stopped itself. Only unicron's lines must have none.
    ours = "\n".join(line for line in err.splitlines() if not line.startswith("[rank"))
    assert "Traceback" not in ours and "internal error" not in ours, err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 2
    decisions = [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    assert len(decisions) == 1 and "a real fault after the garbage" in decisions[0]["reason"], decisions


def test_a_temp_dir_too_long_for_a_unix_socket_still_heals(workdir, reference_hash) -> None:
    """TMPDIR deeper than a socket path may be (as on some clusters' per-job scratch): the
    agent puts its workers' channel in a short temp dir instead, and the exception a worker
    forwards over it still heals the job (it used to be an internal error, exit 70)."""
    deep = workdir / ("t" * 60) / ("u" * 40)
    deep.mkdir(parents=True)
    args = ["run", *COMMON, "--log-dir", str(workdir / "logs"), "--inject", "exception@0:6",
            str(workdir / "train_state.py"), "--steps", "12", "--out", str(workdir / "healed.txt"), "--sleep", "0.02"]
    code, out, err = run_unicron(args, workdir, timeout=100, env=clean_env(TMPDIR=str(deep)))
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    faults = [e for e in read_events(workdir / "logs") if e["kind"] == "fault"]
    assert faults[0]["fault_kind"] == "exception", faults


def test_a_failure_right_after_a_restore_is_reported_at_the_restored_step(workdir, reference_hash) -> None:
    code, out, err = _train(workdir, "healed.txt", "--inject", "kill@1:5", script_args=("--fail-after-restore", "0"))
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 3 and starts[1]["restore_step"] == starts[2]["restore_step"]
    # The rank had restored that step when it failed: the step it had reached, not 0.
    assert f"exception on rank 0 at step {starts[1]['restore_step']}: RuntimeError: failing on purpose" in err, err


def test_hang_is_detected_culprit_named_and_healed(workdir, reference_hash) -> None:
    code, out, err = _train(workdir, "healed.txt", "--inject", "hang@1:6", steps=12, sleep=0.05)
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    hang = [e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hang, [e for e in events if e["kind"] == "fault"]
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["culprits"] == [1], decision
    assert "idle" in hang[0]["message"], hang[0]
    # The dumps the verdict came from are kept with the attempt's logs (acceptance 23C F2).
    (dump,) = (workdir / "logs").glob("*/attempt_0/stacks/rank1.txt")
    assert "hang_forever" in dump.read_text()


def test_a_frozen_rank_is_named_and_the_job_heals(workdir, reference_hash) -> None:
    """A SIGSTOPped rank gives no stack dump while its peer waits in the all-reduce: it is the
    suspect, and stopping it does not wait out the grace period (it is continued)."""
    code, out, err = _train(workdir, "healed.txt", "--inject", "freeze@1:6", "--grace-period", "60",
                            steps=12, sleep=0.05)
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["culprits"] == [1], decision
    assert "suspect rank(s) 1, which gave no stack" in decision["reason"], decision
    # The frozen rank exited on SIGTERM once continued: no SIGKILL after the 60 s grace.
    stopped = next(e for e in events if e["kind"] == "workers_stopped")
    assert stopped["killed_ranks"] == [], stopped


# Each pause is 6 s past a 3 s busy floor, at steps 5, 7, 9 and 11 of one run: Python moving
# (eval), writing a file (io), a helper process computing while the worker waits (helper), a
# thread pool evaluating while the main thread waits (thread): all work.
WORK_PAUSES = ",".join(f"{kind}@1:{step}:6" for kind, step in (("eval", 5), ("io", 7), ("helper", 9), ("thread", 11)))


@pytest.mark.parametrize(("pauses", "flags"), [
    (WORK_PAUSES, ("--hang-busy-floor", "3")),
    ("native@1:5:5", ()),  # CPU in one C call, Python still: the busy threshold (10 s) applies
    ("calls@1:5:14", ()),  # C calls one after another: work, though each sample finds the same call
])
def test_long_phase_between_steps_is_not_a_hang(workdir, reference_hash, pauses, flags) -> None:
    # Rank 1 spends seconds between two steps while rank 0 idles in a barrier: far beyond the
    # idle threshold (1.5 s), and it must not be called a hang.
    code, out, err = _train(workdir, "paused.txt", *flags, script_args=("--pause", pauses))
    assert code == 0, err
    assert (workdir / "paused.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    faults = [(e.get("fault_kind"), e.get("rank"), e.get("message"), e.get("summary")) for e in events
              if e["kind"] == "fault"]
    assert not faults, faults
    assert len([e for e in events if e["kind"] == "attempt_start"]) == 1


def test_startup_error_is_not_retried(workdir) -> None:
    (workdir / "broken.py").write_text("import torch\nimport no_such_module_xyz\n")
    code, out, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), str(workdir / "broken.py")],
                                 workdir, timeout=60)
    assert code != 0
    assert "no_such_module_xyz" in err
    assert "user error" in err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 1


@pytest.mark.parametrize("program", ["./no_such_program", "./not_executable.sh"])
def test_a_program_that_cannot_be_started_is_a_user_error_not_a_lost_node(workdir, program) -> None:
    (workdir / "not_executable.sh").write_text("#!/bin/sh\necho never\n")  # mode 644
    code, _, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), "--no-python", program],
                               workdir, timeout=60)
    assert code == 1, err
    assert "user error, not restarted" in err and "could not be started" in err and program in err, err
    assert "left" not in err and "waiting for" not in err, err
    events = read_events(workdir / "logs")
    assert [(d["severity"], d["rule"]) for d in events if d["kind"] == "decision"] == [("FATAL", "startup-failed")]


def test_a_state_misuse_stops_the_job_without_a_restart(workdir) -> None:
    # A per-epoch batch index as commit()'s step: restarting would replay it, and restoring
    # "the newest step" would pair ranks from different epochs.
    (workdir / "epochs.py").write_text(
        "import torch, torch.distributed as dist, unicron\n"
        "dist.init_process_group('gloo')\n"
        "m = torch.nn.Linear(2, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "state = unicron.State(model=m, optimizer=opt); state.restore()\n"
        "for epoch in range(3):\n"
        "    for batch in range(4):\n"
        "        opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step()\n"
        "        dist.barrier(); state.commit(batch + 1)\n")
    code, _, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), str(workdir / "epochs.py")],
                               workdir, timeout=60)
    assert code != 0
    assert "the step must not go back" in err and "a restart would repeat it" in err, err
    events = read_events(workdir / "logs")
    assert len([e for e in events if e["kind"] == "attempt_start"]) == 1
    assert [d["severity"] for d in events if d["kind"] == "decision"] == ["FATAL"]


@pytest.mark.parametrize("hooks", [True, False], ids=["hooks", "no-inject"])
def test_a_ddp_model_built_without_the_worker_hooks_is_said_not_to_restore_bit_for_bit(workdir, hooks: bool) -> None:
    """Acceptance 26B F1: under --no-inject a restored DDP model ends with other parameters than
    the run without the fault (its bucket order is not restored), and nothing said so."""
    (workdir / "ddp.py").write_text(
        "import torch, torch.distributed as dist, unicron\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "dist.init_process_group('gloo')\n"
        "m = DDP(torch.nn.Linear(2, 2)); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "state = unicron.State(model=m, optimizer=opt); start = state.restore()\n"
        "for step in range(start, 3):\n"
        "    opt.zero_grad(); m(torch.ones(1, 2)).sum().backward(); opt.step(); state.commit(step + 1)\n")
    code, _, err = run_unicron(["run", *COMMON, *([] if hooks else ["--no-inject"]), str(workdir / "ddp.py")],
                               workdir, timeout=60)
    assert code == 0, err
    said = err.count("unicron: the DistributedDataParallel 'model' was built without unicron's worker hooks")
    assert said == (0 if hooks else 1), err  # rank 0's, once


DDP_TWICE = r"""
import hashlib, os, sys
import torch, torch.distributed as dist, unicron
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
# 1000-byte buckets: several, whose layout decides the order of the ring's sums on 3 ranks
m = DDP(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]), bucket_cap_mb=0.001)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
state = unicron.State(model=m, optimizer=opt)
start = state.restore()
second_fault = sys.argv[2] == "fault" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "1"
for step in range(start, 8):
    if second_fault and step == start + 1:  # the restored attempt fails after its first commit
        raise RuntimeError("second fault")
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
    opt.zero_grad(); m(x).pow(2).sum().backward(); opt.step(); state.commit(step + 1)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in m.parameters())).hexdigest())
"""


@pytest.mark.timeout(200)
def test_a_ddp_restored_attempt_keeps_its_first_commit_and_stays_bit_exact(workdir) -> None:
    """Acceptance 31A F3: a DDP built in a restored worker took no snapshot at its first commit
    (its rebuild was counted as pending though its layout was restored), so a second fault lost
    two steps. The attempt after it restores that first commit and ends bit for bit as a run
    without faults."""
    (workdir / "ddp2.py").write_text(DDP_TWICE)
    three = ["--standalone", "--nproc-per-node", "3", "--grace-period", "2", "--first-step-timeout", "60"]
    code, _, err = run_unicron(["run", *three, "--log-dir", str(workdir / "ref"), str(workdir / "ddp2.py"),
                                str(workdir / "ref.txt"), "none"], workdir, timeout=90)
    assert code == 0, err
    code, _, err = run_unicron(["run", *three, "--max-restarts", "3", "--inject", "kill@1:4", "--log-dir",
                                str(workdir / "logs"), str(workdir / "ddp2.py"), str(workdir / "out.txt"), "fault"],
                               workdir, timeout=100)
    assert code == 0, err
    starts = [e["restore_step"] for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 3 and starts[1] in (3, 4) and starts[2] == starts[1] + 1, (starts, err)
    assert (workdir / "out.txt").read_text() == (workdir / "ref.txt").read_text()


def _run_dying(workdir, dying_rank: str) -> tuple[int, str, int]:
    """Run a job whose rank ``dying_rank`` (a Python expression) exits 3 right after joining,
    before any step; return the exit code, stderr and the number of attempts."""
    (workdir / "dies.py").write_text(
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        f"if dist.get_rank() == {dying_rank}:\n    os._exit(3)\n"
        "dist.barrier()\n")
    code, _, err = run_unicron(["run", *COMMON[:3], "--max-restarts", "10", "--grace-period", "1",
                                "--log-dir", str(workdir / "logs"), str(workdir / "dies.py")], workdir, timeout=90)
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    return code, err, len(starts)


def test_crash_loop_guard_stops_a_job_that_never_progresses(workdir) -> None:
    # A different rank dies on each attempt, so no escalation rule about "the same place" can
    # fire first: only the guard (3 restarts in a row without a completed step) stops it.
    code, err, attempts = _run_dying(workdir, "int(os.environ['TORCHELASTIC_RESTART_COUNT']) % 2")
    assert code != 0
    assert "crash loop" in err
    assert attempts == 4  # the first attempt and 3 restarts without progress


def test_restored_attempts_that_fail_again_at_the_same_step_are_a_crash_loop(workdir) -> None:
    # Rank 1 raises after step 6's optimizer step, before its commit: every attempt restores
    # step 5, redoes step 6 (one step of progress each time) and fails the same way.
    code, out, err = _train(workdir, "x.txt", "--max-restarts", "10", script_args=("--raise-after-step", "1:6"))
    assert code != 0
    assert "crash loop: 3 restarts without completing a step that an earlier attempt had not" in err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert [s["restore_step"] for s in starts[1:]] == [5, 5, 5]
    assert len(starts) == 4


SELF_CHECKPOINTING = r"""
import os, sys
import torch
import torch.distributed as dist

# torchrun's elastic pattern: the script checkpoints itself and resumes from its file; every
# process fails after 6 steps of its own life (a leak), each attempt 5 steps further on.
dist.init_process_group("gloo")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt, start = sys.argv[1], 0
if os.path.exists(ckpt):
    saved = torch.load(ckpt, weights_only=True)
    model.load_state_dict(saved["model"])
    start = saved["step"]
if dist.get_rank() == 0:  # one rank: two ranks' lines may interleave on the shared console
    print(f"rank 0 resumes at {start}", flush=True)
for step in range(start, 25):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    if (step + 1) % 5 == 0 and dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "step": step + 1}, ckpt + ".tmp")
        os.replace(ckpt + ".tmp", ckpt)
    dist.barrier()
    if step + 1 - start == 6:
        raise MemoryError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")
dist.destroy_process_group()
"""


def test_a_script_that_resumes_from_its_own_checkpoint_is_not_taken_for_a_crash_loop(workdir) -> None:
    """Every attempt fails after the same number of its own steps, with the same error, but
    starts where the one before checkpointed: the job moves on, and is restarted until done as
    under torchrun (acceptance 21A F1: it was stopped as a crash loop at the 4th failure)."""
    (workdir / "selfckpt.py").write_text(SELF_CHECKPOINTING)
    code, out, err = run_unicron(["run", *COMMON[:3], "--max-restarts", "6", "--grace-period", "1",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "selfckpt.py"),
                                  str(workdir / "ckpt.pt")], workdir, timeout=150)
    assert code == 0, err
    assert [line for line in out.splitlines() if line.startswith("rank 0 resumes")] == [
        f"rank 0 resumes at {at}" for at in (0, 5, 10, 15, 20)]
    assert "crash loop" not in err


def test_same_rank_failing_again_without_progress_stops_a_fixed_size_job(workdir) -> None:
    code, err, attempts = _run_dying(workdir, "1")
    assert code != 0
    assert "failed again after a restart without completing a step" in err
    assert attempts == 2


def test_restart_budget_is_job_wide(workdir) -> None:
    code, out, err = _train(workdir, "x.txt", "--inject", "kill@1:3", "--max-restarts", "0")
    assert code != 0
    assert "budget" in err
    # The rank's notice of the fault it injects comes before the agent's line on its exit, as
    # the README shows (acceptance 33B F5: the tee echoed it up to 0.1 s later, after it).
    lines = err.splitlines()
    notice = next(i for i, line in enumerate(lines) if "injected fault on rank 1 after step 3" in line)
    exit_line = next(i for i, line in enumerate(lines) if "exit on rank 1 at step 3" in line)
    assert notice < exit_line, err


def test_a_native_spin_past_the_busy_threshold_is_a_hang(workdir) -> None:
    code, out, err = _train(workdir, "spin.txt", "--hang-busy-floor", "3", "--max-restarts", "0",
                            script_args=("--pause", "native@1:5:30"))
    assert code != 0
    hang = [e for e in read_events(workdir / "logs") if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hang and "busy" in hang[0]["message"], hang
    assert hang[0]["latency_s"] >= 3.0


def test_a_straggler_is_not_a_hang(workdir, reference_hash) -> None:
    # Rank 1 computes 1.8 s longer at each of the last three steps: beyond the idle threshold,
    # but its rank is busy, so the job goes on (a sleeping rank would be an idle stall).
    code, out, err = _train(workdir, "slow.txt", "--inject", "slow=1.8@1:9")
    assert code == 0, err
    assert (workdir / "slow.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] == "fault"]


ORPHAN = """\
import os, sys, time
# A double-forked helper: its parent exits at once, so it is orphaned to the agent (a child
# subreaper); it exits a moment later. The worker then waits for it to be reaped by the agent
# while the job runs (a zombie keeps its /proc entry).
r, w = os.pipe()
child = os.fork()
if child == 0:
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        time.sleep(0.2)
        os._exit(0)
    os._exit(0)
os.waitpid(child, 0)
pid = int(os.read(r, 32))
deadline = time.monotonic() + 20
while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
    time.sleep(0.1)
print("orphan", pid, "reaped" if not os.path.exists(f"/proc/{pid}") else "still a zombie", flush=True)
sys.exit(0 if not os.path.exists(f"/proc/{pid}") else 1)
"""


def test_orphan_that_exits_during_the_run_is_reaped_at_once(workdir) -> None:
    (workdir / "orphan.py").write_text(ORPHAN)
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "0",
                                  "--log-dir", str(workdir / "logs"), "--tee", "3",
                                  str(workdir / "orphan.py")], workdir, timeout=60)
    assert code == 0, out + err
    reaped = [e for e in read_events(workdir / "logs") if e["kind"] == "orphans_reaped"]
    assert reaped, "the agent did not reap the orphan"


LEAVES_HELPERS = """\
import os, signal, subprocess, sys, time
# Each attempt's rank starts a helper in a session of its own (out of the worker's process
# group), records its pid, and then: attempt 0 is SIGKILLed, attempt 1 finishes cleanly.
pids = sys.argv[1]
helper = subprocess.Popen(["sleep", "300"], start_new_session=True)
with open(pids, "a") as f:
    f.write(f"{helper.pid}\\n")
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    os.kill(os.getpid(), signal.SIGKILL)
print("done", flush=True)
"""


def test_helpers_a_worker_left_behind_are_stopped_at_restart_and_at_the_end(workdir) -> None:
    """What a worker started in a session of its own outlives it, re-parented to the agent: it
    goes with its attempt, after a crash and after a clean finish alike."""
    import psutil

    (workdir / "helpers.py").write_text(LEAVES_HELPERS)
    pids = workdir / "pids.txt"
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "helpers.py"), str(pids)],
                                 workdir, timeout=90)
    assert code == 0, out + err
    helpers = [int(x) for x in pids.read_text().split()]
    assert len(helpers) == 2, helpers
    left = [p for p in helpers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for pid in left:  # don't leave them behind for the next test either
        os.kill(pid, 9)
    assert not left, f"helpers left running: {left}"


LEAVES_EARLY = """\
import os, sys
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, first = dist.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.1)
for step in range(1, 31):
    loss = (w * w).sum()
    loss.backward()
    dist.all_reduce(w.grad)
    opt.step()
    opt.zero_grad()
    if first and rank == 1 and step == 10:
        EXIT(0)  # a bug: this rank thinks it is done
dist.destroy_process_group()
print("done", rank, flush=True)
"""


@pytest.mark.parametrize("how", ["os._exit", "sys.exit"])
def test_a_rank_that_exits_0_early_is_named_as_why_its_peer_failed(workdir, how) -> None:
    """Rank 1 ends cleanly mid-job (in the first attempt only, as a preempted rank that saved and
    left); rank 0 then loses its peer. torchrun blames rank 0; unicron leads with rank 1, and
    restarts. With ``sys.exit(0)`` its sockets close while its interpreter still tears down: it is
    named all the same."""
    (workdir / "early.py").write_text(LEAVES_EARLY.replace("EXIT", how))
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "early.py")], workdir, timeout=90)
    assert code == 0, out + err
    decision = next(e for e in read_events(workdir / "logs") if e["kind"] == "decision")
    assert decision["rule"] == "uneven-end" and decision["action"] == "restart", decision
    assert decision["reason"].startswith("rank 1 after step 10 exited with code 0 while rank 0"), decision
    assert "SEV2 restart: rank 1 after step 10 exited with code 0" in err, err


def test_ranks_that_end_unevenly_in_every_attempt_stop_after_one_restart(workdir) -> None:
    """The uneven end of the script's own logic (uneven inputs): the same after the restart, so the
    job stops as a user error, leading with the rank that left, rather than spending its budget
    (torchrun restarts until the budget is spent, then fails)."""
    (workdir / "early.py").write_text(LEAVES_EARLY.replace("EXIT", "os._exit").replace("if first and", "if"))
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "5",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "early.py")], workdir, timeout=90)
    assert code == 1, out + err
    decisions = [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    assert [(d["action"], d["severity"]) for d in decisions] == [("restart", "SEV2"), ("stop", "FATAL")], decisions
    assert "again after a restart: ranks that end at different steps" in decisions[1]["reason"]
    assert "FATAL stop: rank 1 after step 10 exited with code 0" in err, err


def test_a_launcher_stalled_for_seconds_keeps_its_job(workdir) -> None:
    """A stall of the launcher process itself (SIGSTOP here; a VM pause or swap in life) longer
    than the heartbeat timeout: its embedded coordinator heard nobody meanwhile, which says
    nothing about the node, so the job goes on (torchrun's does)."""
    import shutil
    import signal
    import time

    from e2e import SCRIPTS, Launched, wait_for

    shutil.copy(SCRIPTS / "train_state.py", workdir)
    logs = workdir / "logs"
    job = Launched(["run", *COMMON, "--max-restarts", "0", "--log-dir", str(logs), str(workdir / "train_state.py"),
                    "--steps", "60", "--out", str(workdir / "out.txt"), "--sleep", "0.1"], workdir)
    try:
        wait_for(lambda: any(e["kind"] == "workers_started" for e in read_events(logs)) if list(logs.glob("*"))
                 else False, 60, "the workers to start")
        job.proc.send_signal(signal.SIGSTOP)
        time.sleep(4.5)  # the stall itself, longer than the 3 s heartbeat timeout
        job.proc.send_signal(signal.SIGCONT)
        code, out, err = job.wait(90)
    finally:
        job.kill()
    assert code == 0, out + err
    assert not [e for e in read_events(logs) if e["kind"] in ("node_lost", "fault")]


def test_a_hang_before_a_restarts_first_step_is_found_from_the_earlier_startup(workdir, reference_hash) -> None:
    """Rank 0 sleeps after restoring in the first restart while rank 1 waits in the first step's
    all_reduce: every rank idle. The first attempt's start-up (a second or two) was measured: the
    restart is held to 5 x that (at least a tenth of --first-step-timeout, 6 s here), not to the
    whole 60 s."""
    code, out, err = _train(workdir, "healed.txt", "--inject", "kill@1:5", script_args=("--hang-after-restore", "0"))
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    hang = next(e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang")
    assert hang["attempt"] == 1 and "warm-up allowance" in hang["message"], hang
    allowance = float(hang["message"].split("warm-up allowance ")[1].split("s")[0])
    assert 6.0 <= allowance < 60.0, hang["message"]
    decision = [e for e in events if e["kind"] == "decision"][1]
    assert decision["culprits"] == [0], decision


@pytest.mark.parametrize("kind", ["native", "loader"])
def test_a_restart_that_works_before_its_first_step_keeps_the_whole_allowance(workdir, reference_hash, kind) -> None:
    """In the first restart rank 0 spends 8 x the first attempt's start-up (at least 14 s) before
    its first step, longer than the restart's idle allowance, while rank 1 waits in that step:
    computing in C calls (busy: the CPU the agent samples) or waiting for a data loader's worker
    that sleeps (the worker's own report, from its start in a restart). Neither is a hang."""
    code, out, err = _train(workdir, "healed.txt", "--inject", "kill@1:5",
                            script_args=("--pause-after-restore", kind))
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang"], err
    paused_s = max(8 * float((workdir / "healed.txt.startup").read_text()), 14.0)
    restart = next(e for e in events if e["kind"] == "workers_started" and e["attempt"] == 1)
    assert restart["first_step_allowance_s"] < paused_s - 2, (restart, paused_s)  # the pause outlasted it


def test_work_before_the_first_step_outlasts_the_first_step_timeout(workdir, reference_hash) -> None:
    """Rank 0 preprocesses (forward passes: Python moving) for 16 s before its first step while
    rank 1 waits in that step, with --first-step-timeout 10: work seen from 0.4 x the timeout
    on restarts its clock (acceptance pass 14: a 330 s tokenisation was killed at 300 s)."""
    code, out, err = _train(workdir, "slowstart.txt", "--first-step-timeout", "10",
                            script_args=("--pause-at-start", "eval:16"))
    assert code == 0, err
    assert (workdir / "slowstart.txt").read_text() == reference_hash
    assert not [e for e in read_events(workdir / "logs") if e["kind"] == "fault"], err
