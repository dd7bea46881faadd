"""What scripts/gpu_checks.py's checks share: the run context, the pure helpers that read a job's
events, and running ``unicron run`` jobs (and probe scripts) with a timeout, reaping what they leave."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULT_STEP = 5
ASSERT_STEP = 3
STEPS = 120
NPROC = 2

JOBS = Path(__file__).resolve().parent / "gpu_checks_jobs"  # the scripts the checks run



@dataclass
class Context:
    device: str  # "cuda" or "cpu"
    backend: str
    device_count: int
    work: Path
    env: dict[str, str]
    deadline: float = 0.0  # monotonic: the running check must be done by then

    def left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())


Result = tuple[bool, str, dict[str, Any]]  # ok, one-line summary, details


# ---- pure helpers ------------------------------------------------------------------------------


def choose_backend(device: str, device_count: int, nproc: int) -> tuple[str, str]:
    """Backend for an ``nproc``-rank job on one node, and why (NCCL needs a GPU per rank)."""
    if device != "cuda":
        return "gloo", "no GPU: gloo on CPU tensors"
    if device_count >= nproc:
        return "nccl", f"{device_count} GPUs for {nproc} ranks"
    return "gloo", f"{device_count} GPU(s) for {nproc} ranks: NCCL refuses two ranks on one GPU; gloo on CUDA tensors"


def fault_time(step_log: str, step: int, attempt: int = 0) -> float | None:
    """When a rank was about to complete ``step`` of ``attempt`` (its last "pre" line), from its step log."""
    found = None
    for parts in (line.split() for line in step_log.splitlines()):
        if len(parts) == 4 and parts[0] == "pre" and parts[1] == str(step) and parts[3] == str(attempt):
            found = float(parts[2])
    return found


def summarize_job(events: list[dict[str, Any]], fault_ts: float | None, rank: int | None) -> dict[str, Any]:
    """What one ``unicron run`` did, from its events: the first fault (of ``rank``, or a hang), decisions, restarts."""
    events = sorted(events, key=lambda e: e.get("ts", 0.0))
    faults = [e for e in events if e.get("kind") == "fault" and "node_id" not in e]  # the agent's, not the copies
    mine = [e for e in faults if e.get("rank") == rank or e.get("fault_kind") == "hang"] or faults
    first = mine[0] if mine else None
    decisions = [{k: e.get(k) for k in ("attempt", "action", "severity", "rule", "reason", "culprits")}
                 for e in events if e.get("kind") == "decision"]
    restores = [e.get("restore_step") for e in events if e.get("kind") == "attempt_start" and e.get("attempt")]
    end = next((e for e in events if e.get("kind") == "job_end"), None)
    keys = ("fault_kind", "rank", "exitcode", "signal", "error_type", "message", "latency_s", "steps_completed")
    return {
        "first_fault": None if first is None else {k: first[k] for k in keys if first.get(k) is not None},
        "detection_s": round(first["ts"] - fault_ts, 3) if first and fault_ts is not None and "ts" in first else None,
        "decisions": decisions,
        "culprit_named": None if rank is None else any(rank in (d.get("culprits") or []) for d in decisions),
        "attempts": sum(1 for e in events if e.get("kind") == "attempt_start"),
        "restore_step": restores[0] if restores else None,
        "warm": [e.get("warm") for e in events if e.get("kind") == "workers_started"],
        "job_end": None if end is None else {"exit_code": end.get("exit_code"), "reason": end.get("reason")},
    }


def describe_decision(summary: dict[str, Any]) -> str:
    d = summary["decisions"][0] if summary["decisions"] else None
    return "no decision" if d is None else f"{d['severity']} {d['action']} ({d['rule']}), culprits {d['culprits']}"


# ---- processes ---------------------------------------------------------------------------------


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(log_dir.rglob("events.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL and wait for processes whose command line or directory holds ``marker``, a directory
    only this run created (forked workers may show their zygote's command line, not their own)."""
    import psutil

    procs = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and marker in " ".join([*(proc.info["cmdline"] or []), proc.info["cwd"] or ""]):
                proc.kill()
                procs.append(proc)
    psutil.wait_procs(procs, timeout=5)
    return [proc.pid for proc in procs]


def run_command(cmd: list[str], env: dict[str, str], timeout_s: float, cwd: Path) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own session and reap it; on timeout SIGTERM its group (unicron stops its
    workers), SIGKILL 15 s later. Returns (exit code, None on timeout; stdout; stderr)."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, None)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, err = proc.communicate(timeout=wait_s)
                break
        return None, out, err + f"\n[gpu_checks] timed out after {timeout_s:.0f}s"


def run_job(ctx: Context, name: str, *, inject: str | None, max_restarts: int, sync: str = "barrier",
            assert_step: int = 0, nproc: int = NPROC, backend: str | None = None, fault_rank: int = 1,
            stall: str = "", flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> dict[str, Any]:
    """``unicron run`` of gpu_checks_jobs/train_check.py (2 ranks): the summary of its events, exit code, output
    tails. ``fault_rank`` is the rank the fault hits (its step log times the fault); ``stall``: ``spin`` makes it
    stop making progress at FAULT_STEP of the first attempt for real (train_check.py); ``flags`` go to
    ``unicron run``, ``env`` to the job."""
    work = ctx.work / name
    log_dir, step_logs, script = work / "logs", work / "steps", work / "train_check.py"
    step_logs.mkdir(parents=True)
    shutil.copy(JOBS / "train_check.py", script)
    cmd = [sys.executable, "-m", "unicron", "run", "--standalone", "--nproc-per-node", str(nproc),
           "--grace-period", "3", "--max-restarts", str(max_restarts),
           "--log-dir", str(log_dir), *(["--inject", inject] if inject else []), *flags,
           str(script), str(STEPS), sync, str(assert_step), str(step_logs)]
    t0 = time.monotonic()
    try:
        job_env = {**ctx.env, "GPU_CHECK_BACKEND": backend or ctx.backend, "GPU_CHECK_FAULT_RANK": str(fault_rank),
                   "GPU_CHECK_STALL": stall, "GPU_CHECK_STALL_STEP": str(FAULT_STEP), **(env or {})}
        code, out, err = run_command(cmd, job_env, ctx.left(), work)
    finally:
        leftovers = kill_leftovers(str(work))
    rank_log = step_logs / f"rank{fault_rank}.txt"
    step = FAULT_STEP if inject or stall else assert_step
    events = read_events(log_dir)
    summary = summarize_job(events, fault_time(rank_log.read_text(), step) if rank_log.exists() else None,
                            fault_rank)
    summary.update(nproc=nproc, exit_code=code, wall_s=round(time.monotonic() - t0, 2), backend=job_env["GPU_CHECK_BACKEND"],
                   command=" ".join(cmd[2:]), stdout_tail=out[-1500:], stderr_tail=err[-3000:],
                   leftover_pids_killed=leftovers, events=events[-80:])
    return summary


def run_probe(ctx: Context, script: str) -> dict[str, Any]:
    """A job script that prints one JSON line: that line, or what it printed when it did not."""
    code, out, err = run_command([sys.executable, str(JOBS / script)], ctx.env, min(ctx.left(), 120), ctx.work)
    try:
        return dict(json.loads(out.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        return {"exit_code": code, "stdout": out[-1000:], "stderr": err[-2000:]}

