"""End to end: real `unicron run` jobs with gloo workers, faults injected for real, and the
final model compared bit for bit with a failure-free run."""

from __future__ import annotations

import pytest
from e2e import read_events, run_unicron

pytestmark = pytest.mark.slow

COMMON = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--grace-period", "2",
          "--hang-floor", "2", "--hang-factor", "3", "--first-step-timeout", "60"]


def _train(workdir, out: str, *extra: str, steps: int = 12, sleep: float = 0.02) -> tuple[int, str, str]:
    args = ["run", *COMMON, "--log-dir", str(workdir / "logs"), *extra,
            str(workdir / "train_state.py"), "--steps", str(steps), "--out", str(workdir / out),
            "--sleep", str(sleep)]
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


def test_hang_is_detected_culprit_named_and_healed(workdir, reference_hash) -> None:
    code, out, err = _train(workdir, "healed.txt", "--inject", "hang@1:6", steps=12, sleep=0.05)
    assert code == 0, err
    assert (workdir / "healed.txt").read_text() == reference_hash
    events = read_events(workdir / "logs")
    hang = [e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hang, [e for e in events if e["kind"] == "fault"]
    decision = next(e for e in events if e["kind"] == "decision")
    assert decision["culprits"] == [1], decision


def test_startup_error_is_not_retried(workdir) -> None:
    (workdir / "broken.py").write_text("import torch\nimport no_such_module_xyz\n")
    code, out, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), str(workdir / "broken.py")],
                                 workdir, timeout=60)
    assert code != 0
    assert "no_such_module_xyz" in err
    assert "user error" in err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 1


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


def test_same_rank_failing_again_without_progress_stops_a_fixed_size_job(workdir) -> None:
    code, err, attempts = _run_dying(workdir, "1")
    assert code != 0
    assert "failed again after a restart without completing a step" in err
    assert attempts == 2


def test_restart_budget_is_job_wide(workdir) -> None:
    code, out, err = _train(workdir, "x.txt", "--inject", "kill@1:3", "--max-restarts", "0")
    assert code != 0
    assert "budget" in err
