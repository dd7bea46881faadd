"""scripts/gpu_checks.py: the no-CUDA path, its pure helpers, and its job checks run for real on CPU (--cpu)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_checks.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_checks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_checks"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gc = load_script()


def run_script(args: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str, str]:
    env = {**os.environ, "TMPDIR": str(cwd)}  # its work directory under cwd: the fixture finds what outlives it
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out, err


# ---- the path this machine takes ------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run its checks")
def test_without_cuda_it_says_so_in_one_line_writes_json_and_exits_0(workdir: Path) -> None:
    out_file = workdir / "out" / "gpu_checks.json"
    code, out, err = run_script(["--out", str(out_file)], workdir)
    assert code == 0, err
    assert out.splitlines() == [out.strip()] and out.startswith("gpu_checks: no CUDA, no check run: ")
    assert "torch.cuda.is_available() is False" in out and "Traceback" not in err
    result = json.loads(out_file.read_text())
    assert result["cuda"] is False and result["checks"] == [] and result["finished"] is True
    assert result["torch"] == torch.__version__ and "is_available() is False" in result["reason"]


def test_an_unknown_check_is_one_error_line(workdir: Path) -> None:
    code, out, err = run_script(["--out", str(workdir / "x.json"), "--only", "hang,nccl-magic"], workdir)
    assert code == 2 and out == ""
    assert err.strip() == "gpu_checks: unknown check(s) nccl-magic; choose from " + ", ".join(gc.CHECKS)
    assert not (workdir / "x.json").exists()


# ---- pure helpers ---------------------------------------------------------------------------


def test_only_keeps_the_run_order_and_rejects_unknown_names() -> None:
    assert gc.parse_only(None) == list(gc.CHECKS)
    assert gc.parse_only(" crash, pynvml ,") == ["pynvml", "crash"]
    for bad in ("hang,nope", ",", "warm;hang"):
        with pytest.raises(ValueError, match="choose from"):
            gc.parse_only(bad)


def test_backend_is_nccl_only_with_a_gpu_per_rank() -> None:
    assert gc.choose_backend("cuda", 8, 2)[0] == "nccl"
    backend, why = gc.choose_backend("cuda", 1, 2)
    assert backend == "gloo" and "NCCL refuses two ranks on one GPU" in why
    assert gc.choose_backend("cpu", 0, 2)[0] == "gloo"


def test_fault_time_is_the_last_pre_line_of_that_step_and_attempt() -> None:
    log = "pre 4 10.5 0\npre 5 11.25 0\npre 5 11.5 0\ngarbage\npre 5 30.0 1\n"
    assert gc.fault_time(log, 5) == 11.5
    assert gc.fault_time(log, 5, attempt=1) == 30.0
    assert gc.fault_time(log, 6) is None and gc.fault_time("", 5) is None


def event(ts: float, kind: str, **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "kind": kind, "job": "j", "node": "vm", **fields}


# Shaped like a real run's events.jsonl (a --cpu crash run): the victim rank 0 is reported first,
# and the coordinator writes its own copy of each fault (with node_id).
CRASH_EVENTS = [
    event(100.0, "attempt_start", attempt=0, restore_step=None),
    event(101.0, "workers_started", attempt=0, warm=2),
    event(103.20, "fault", fault_kind="exception", rank=0, error_type="RuntimeError", steps_completed=5),
    event(103.21, "fault", fault_kind="exit", rank=1, exitcode=-9, signal="SIGKILL", steps_completed=5),
    event(103.22, "fault", fault_kind="exit", rank=1, node_id="vm-1", exitcode=-9, signal="SIGKILL"),
    event(103.30, "decision", attempt=0, action="restart", severity="SEV2", rule="sigkill", reason="r", culprits=[]),
    event(103.40, "attempt_start", attempt=1, restore_step=4),
    event(103.50, "workers_started", attempt=1, warm=2),
    event(108.00, "job_end", exit_code=0, reason="all workers finished successfully"),
]


def test_summary_names_the_faulted_ranks_fault_and_the_restore() -> None:
    s = gc.summarize_job(list(reversed(CRASH_EVENTS)), 103.0, 1)
    assert s["first_fault"] == {"fault_kind": "exit", "rank": 1, "exitcode": -9, "signal": "SIGKILL",
                                "steps_completed": 5}
    assert s["detection_s"] == pytest.approx(0.21)
    assert s["decisions"] == [{"attempt": 0, "action": "restart", "severity": "SEV2", "rule": "sigkill",
                               "reason": "r", "culprits": []}]
    assert s["culprit_named"] is False and s["attempts"] == 2 and s["restore_step"] == 4
    assert s["warm"] == [2, 2] and s["job_end"]["exit_code"] == 0
    assert gc.describe_decision(s) == "SEV2 restart (sigkill), culprits []"


def test_summary_of_a_hang_and_of_a_job_that_never_started() -> None:
    hang = [event(200.0, "fault", fault_kind="hang", rank=None, latency_s=2.02, steps_completed=5),
            event(200.2, "decision", attempt=0, action="stop", severity="SEV2", rule="hang", reason="h",
                  culprits=[1])]
    s = gc.summarize_job(hang, 197.9, 1)
    assert s["first_fault"]["fault_kind"] == "hang" and s["detection_s"] == pytest.approx(2.1)
    assert s["culprit_named"] is True and s["restore_step"] is None and s["job_end"] is None
    empty = gc.summarize_job([], None, 1)
    assert empty["first_fault"] is None and empty["detection_s"] is None and empty["culprit_named"] is False
    assert gc.describe_decision(empty) == "no decision"


# ---- the job checks, for real, on CPU -------------------------------------------------------


def checks_by_name(path: Path) -> dict[str, dict[str, Any]]:
    result = json.loads(path.read_text())
    assert result["cuda"] is False and result["device"] == "cpu" and result["finished"] is True
    return {c["name"]: c for c in result["checks"]}


@pytest.mark.device_script
@pytest.mark.timeout(300)  # a loaded machine takes minutes for what a quiet one does in one
def test_cpu_run_of_the_warm_hang_crash_and_snapshot_checks(workdir: Path) -> None:
    out_file = workdir / "cpu.json"
    code, out, err = run_script(["--cpu", "--out", str(out_file), "--only", "warm,nccl,hang,hang-item,crash,snapshot"],
                                workdir)
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split()[:2] for line in lines[1:]] == [
        ["[ok]", "warm"], ["[skip]", "nccl"], ["[ok]", "hang"], ["[skip]", "hang-item"], ["[ok]", "crash"],
        ["[ok]", "snapshot"]], out
    checks = checks_by_name(out_file)
    warm = checks["warm"]["details"]
    assert warm["ready"] and warm["disabled"] is None and warm["threads"] == 1 and warm["exit_code"] == 0
    assert warm["driver_probe"]["after_preload"] == "absent"  # no libcuda on this machine at all
    hang = checks["hang"]["details"]
    assert hang["culprit_named"] and hang["decisions"][0]["rule"] == "hang" and hang["exit_code"] == 1
    assert 1.0 <= hang["detection_s"] < 10.0  # the idle floor (1.5 s, counted from the first rank to stall)
    crash = checks["crash"]["details"]
    assert crash["first_fault"]["signal"] == "SIGKILL" and crash["decisions"][0]["rule"] == "sigkill"
    assert crash["restore_step"] == 4 and crash["exit_code"] == 0 and 0 <= crash["detection_s"] < 5.0
    assert crash["leftover_pids_killed"] == [] == hang["leftover_pids_killed"]
    snap = checks["snapshot"]["details"]
    assert snap["device"] == "cpu" and snap["exact"] == [True, True, True] and snap["ratio_background"] > 0


@pytest.mark.device_script
@pytest.mark.timeout(300)  # a loaded machine takes minutes for what a quiet one does in one
def test_cpu_run_of_the_one_rank_fault_checks(workdir: Path) -> None:
    out_file = workdir / "one.json"
    code, out, err = run_script(["--cpu", "--out", str(out_file), "--only", "nccl-faults"], workdir)
    assert code == 0, err
    single = checks_by_name(out_file)["nccl-faults"]  # on CPU: the one-rank jobs over gloo
    assert single["ok"] is True, single
    assert single["details"]["assert"]["decisions"][0]["rule"] == "uncaught-exception"
    assert single["details"]["crash"]["restore_step"] == 4 and single["details"]["crash"]["backend"] == "gloo"


def test_a_check_past_its_timeout_is_stopped_and_recorded(workdir: Path) -> None:
    out_file = workdir / "t.json"
    code, out, err = run_script(["--cpu", "--out", str(out_file), "--only", "crash", "--timeout-per-check", "3"],
                                workdir)
    assert code == 0, err
    crash = checks_by_name(out_file)["crash"]
    assert crash["ok"] is False and crash["details"]["exit_code"] is None  # unicron was stopped, and reaped
    assert "[gpu_checks] timed out after 3s" in crash["details"]["stderr_tail"]
    assert "[FAIL] crash" in out


@pytest.mark.device_script
@pytest.mark.timeout(300)  # a loaded machine takes minutes for what a quiet one does in one
def test_cpu_run_of_the_real_stall_checks(workdir: Path) -> None:
    """No injection: rank 1 is stuck for real in a native call at step 5 (a regular expression
    backtracking for ages). Found as a busy hang and healed; under a 5 s process group timeout
    with unicron's floors at 60 s, gloo's own timeout ends rank 0 first and is classified so."""
    out_file = workdir / "stall.json"
    code, out, err = run_script(["--cpu", "--out", str(out_file), "--only", "gpu-stuck,nccl-timeout,nccl-shared-gpu"],
                                workdir)
    assert code == 0, err
    checks = checks_by_name(out_file)
    stuck, timeout = checks["gpu-stuck"]["details"], checks["nccl-timeout"]["details"]
    assert checks["gpu-stuck"]["ok"] is True, stuck
    assert stuck["first_fault"]["fault_kind"] == "hang" and "busy" in stuck["first_fault"]["message"]
    assert stuck["decisions"][0]["culprits"] == [1] and stuck["restore_step"] == 4
    assert 9.0 <= stuck["detection_s"] < 30.0  # the busy floor, 10 s
    assert checks["nccl-timeout"]["ok"] is True, timeout
    assert timeout["decisions"][0]["rule"] == "collective-timeout" and timeout["first_fault"]["rank"] == 0
    assert 4.0 <= timeout["detection_s"] < 30.0 and timeout["exit_code"] == 0
    assert checks["nccl-shared-gpu"]["ok"] is None  # CUDA only
    assert stuck["leftover_pids_killed"] == [] == timeout["leftover_pids_killed"]
