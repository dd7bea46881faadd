"""unicron on a real GPU: the checks a CPU machine cannot do, in one prepared run of 3-5 minutes.

    .venv/bin/python scripts/gpu_checks.py --out $OUT/gpu_checks.json [--only hang,crash] [--timeout-per-check 90]

Each check is one JSON record (``name, ok, seconds, summary, details`` or ``error``) and one printed line:

- ``pynvml``: ``GpuHealthReader`` (unicron.detect.health) on the real driver, read twice: ECC
  counters, throttle reasons, Xid events; whether its Xid event set opened and NVML supports Xid events.
- ``warm``: a ``WarmPool`` zygote (this process a child subreaper) forks a worker that runs
  ``torch.cuda.init()`` and a matmul on cuda:0; and whether importing the zygote's PRELOAD in a
  fresh python loads or initialises the CUDA driver (``cudadriver.driver_state``: the zygote
  forks from a loaded driver, not from an initialised one), ``driver_states`` through
  ``torch.cuda.init()``, and whether a fork of a process that imported torch can use CUDA.
- ``nccl``: a clean ``unicron run`` over NCCL, one rank per GPU (1 on a one-GPU machine).
- ``hang``: 2 ranks, ``--inject hang@1:5 --max-restarts 0`` (default hang thresholds), steps
  ending in ``dist.barrier()``: fault-to-detection time, decision, culprit rank 1 named, exit code,
  and whether the job was idle or busy when called hung (a CUDA spin-wait counts as busy).
  ``hang-item``: the same with steps ending in ``loss.item()``, as real loops sync, over NCCL (one rank
  when there is one GPU).
- ``cuda-assert``: rank 1 hits a real device-side assert at step 3 of the first attempt,
  ``--max-restarts 1``: the decision (severity, rule, reason) and whether the restart recovered.
- ``crash``: ``--inject kill@1:5 --max-restarts 1`` with ``unicron.State``: detection time,
  decision, recovery (exit 0), ``restore_step``.
- ``nccl-faults`` (one GPU only, where the 2-rank checks run gloo): the ``cuda-assert`` and
  ``crash`` jobs again over NCCL with one rank.
- ``snapshot``: ``unicron.State`` with the model on the GPU: background commits exact, and their cost.
- ``gpu-stuck``: a rank stops for real at step 5, no injection: on CUDA a kernel that spins for
  10 minutes on its stream ahead of the step's NCCL all_reduce (one rank over NCCL), so the host
  waits in a CUDA sync; on CPU (``--cpu``) rank 1 of 2 is stuck in one native call (a regular
  expression backtracking for ages, CPU busy, Python still) while rank 0 waits in gloo.
  Default thresholds, ``--max-restarts 1``: the hang is called (busy), the stuck process killed,
  and the restart restores from memory and finishes.
- ``nccl-timeout``: the same stall under ``init_process_group(timeout=5 s)`` with unicron's hang
  floors raised to 60 s, so the backend's own watchdog ends the process first: on CUDA NCCL's
  ``Watchdog caught collective operation timeout`` (SIGABRT), on CPU gloo's timeout exception;
  the real message's classification (``collective-timeout``) and the restart.
- ``nccl-shared-gpu``: 2 ranks over NCCL on one GPU (both on cuda:0 also where there are more):
  NCCL's real ``ncclInvalidUsage ... Duplicate GPU detected``, which is a launch mistake that
  restarts cannot fix: FATAL, the job stopped at once with one line naming it. CUDA only.

The 2-rank jobs use NCCL with a GPU per rank; on one GPU both ranks share cuda:0 over gloo on
CUDA tensors (NCCL refuses two ranks on one GPU) and the JSON says so. Without CUDA the script
prints one line saying so, writes ``{"cuda": false, ...}`` and exits 0 (``--cpu`` runs the checks
on CPU over gloo instead, to test this script). Each check has a timeout, none starts when less
than 30 s of ``--budget`` (480 s) is left, and the JSON is rewritten after every check. The jobs
and their helpers are in ``_gpu_jobs.py`` and ``gpu_checks_jobs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "scripts"):  # unicron, and _gpu_jobs beside this script when it is loaded by path
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from _gpu_jobs import (  # noqa: E402
    ASSERT_STEP,
    FAULT_STEP,
    JOBS,
    NPROC,
    Context,
    choose_backend,
    describe_decision,
    fault_time,
    run_command,
    run_job,
    run_probe,
    summarize_job,
)

CHECKS = ("pynvml", "warm", "nccl", "hang", "hang-item", "cuda-assert", "crash", "nccl-faults", "snapshot",
          "gpu-stuck", "nccl-timeout", "nccl-shared-gpu")
PG_TIMEOUT_S = 5  # nccl-timeout: the process group's own timeout ...
LATE_FLOORS = ("--hang-floor", "60", "--hang-busy-floor", "60")  # ... which fires long before unicron's hang call
STOP_MARGIN_S = 20.0  # after a check's timeout: time for it to stop its processes and return
WARM_EXPECTED_SUM = 3920  # sum of (A @ A) for A = arange(16).reshape(4, 4)

Result = tuple[bool, str, dict[str, Any]]  # ok, one-line summary, details
NO_NCCL: Result = (True, "skipped: no GPU, no NCCL", {"skip": True})
__all__ = ["choose_backend", "describe_decision", "fault_time", "summarize_job"]  # the tests use them from here


# ---- pure helpers ------------------------------------------------------------------------------


def parse_only(text: str | None) -> list[str]:
    """The checks to run, in CHECKS order; ValueError naming an unknown one."""
    wanted = [n.strip() for n in (text or ",".join(CHECKS)).split(",") if n.strip()]
    unknown = [n for n in wanted if n not in CHECKS]
    if unknown or not wanted:
        raise ValueError(f"unknown check(s) {', '.join(unknown) or repr(text)}; choose from {', '.join(CHECKS)}")
    return [n for n in CHECKS if n in wanted]



# ---- the checks ----------------------------------------------------------------------------------


def check_pynvml(ctx: Context) -> Result:
    from unicron.detect.health import GpuHealthReader, health_faults, read_health

    reader = GpuHealthReader()
    try:
        first = reader.read()
        event_set_open = reader._events is not None  # a diagnostic may look inside
        time.sleep(1.0)  # the second reading reports the Xid events since the first
        host = read_health(reader)
        xid_support: Any = []
        with contextlib.suppress(Exception):  # what NVML says the reader may register, per GPU
            nvml = reader._nvml
            for index in range(nvml.nvmlDeviceGetCount()):
                types = nvml.nvmlDeviceGetSupportedEventTypes(nvml.nvmlDeviceGetHandleByIndex(index))
                xid_support.append(bool(types & nvml.nvmlEventTypeXidCriticalError))
    finally:
        reader.close()
    gpus = host["gpus"]
    details = {"first": first, "host": host, "event_set_open": event_set_open, "xid_supported": xid_support,
               "unavailable_reason": reader.unavailable_reason,
               "health_faults": [f.to_dict() for f in health_faults(None, host)]}
    ok = bool(gpus) and all(g.get("name") for g in gpus) and event_set_open
    line = (f"{[g.get('name') for g in gpus]}: ecc (uncorrected, corrected) "
            f"{[(g.get('ecc_uncorrected'), g.get('ecc_corrected')) for g in gpus]}, throttle "
            f"{[g.get('throttle') for g in gpus]}, xid {[g.get('xid') for g in gpus]}, Xid event set open "
            f"{event_set_open}, Xid supported {xid_support}"
            if gpus else f"no GPU reading: {reader.unavailable_reason or 'NVML lists no GPU'}")
    return ok, line, details



def check_warm(ctx: Context) -> Result:
    from unicron.agent.logs import RankLogs
    from unicron.agent.signals import set_child_subreaper
    from unicron.agent.warm import WarmPool

    probe, states = run_probe(ctx, "driver_probe.py"), run_probe(ctx, "driver_states.py")
    work = ctx.work / "warm"
    work.mkdir()
    shutil.copy(JOBS / "warm_probe.py", work / "warm_probe.py")
    logs = RankLogs(local_rank=0, rank=0, directory=str(work), stdout_path=str(work / "stdout.log"),
                    stderr_path=str(work / "stderr.log"), tee_stdout=False, tee_stderr=False,
                    error_file=str(work / "error.json"), prefix="")
    d: dict[str, Any] = {"driver_probe": probe, "driver_states": states, "subreaper": set_child_subreaper(True)}
    worker = None
    try:
        with WarmPool(1, python=sys.executable, base_env=ctx.env) as pool:
            t0 = time.monotonic()
            pool.refill()
            d["ready"] = pool.wait_ready(min(ctx.left(), 120))
            d.update(ready_s=round(time.monotonic() - t0, 2), disabled=pool.disabled, threads=pool.threads)
            t0 = time.monotonic()
            worker = pool.take([sys.executable, "-u", "-m", "unicron.worker.boot", str(work / "warm_probe.py")],
                               {**ctx.env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}, logs, cwd=str(work))
            d.update(started_warm=worker is not None, miss=pool.last_miss)
            if worker is not None:
                d["exit_code"] = worker.popen.wait(min(ctx.left(), 120))
                d["worker_s"] = round(time.monotonic() - t0, 2)
    finally:
        if worker is not None and worker.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)
            worker.popen.wait()
        set_child_subreaper(False)
    for stream in ("stdout", "stderr"):
        path = work / f"{stream}.log"
        d[stream] = path.read_text()[-3000:] if worker is not None and path.exists() else ""
    result = next((x for x in d["stdout"].splitlines() if x.startswith("WARM_RESULT")), "")
    ok = bool(d.get("started_warm")) and d.get("exit_code") == 0 and f"matmul_sum={WARM_EXPECTED_SUM} " in result
    line = (f"zygote ready {d.get('ready')} in {d.get('ready_s')}s, threads {d.get('threads')}, disabled "
            f"{d.get('disabled')!r}; forked worker exit {d.get('exit_code')}: {result or d.get('miss')}; CUDA driver "
            f"after PRELOAD {probe.get('after_preload')}, after device_count {probe.get('after_device_count')}, after "
            f"torch.cuda.init() {states.get('after_init')}; a fork after import used CUDA: exit "
            f"{states.get('fork_after_import_exit')}")
    return ok, line, d


def check_nccl(ctx: Context) -> Result:
    if ctx.device != "cuda":
        return NO_NCCL
    nproc = min(NPROC, ctx.device_count)  # one rank per GPU
    s = run_job(ctx, "nccl", inject=None, max_restarts=0, nproc=nproc, backend="nccl")
    ok = s["exit_code"] == 0 and not s["decisions"]
    return ok, f"{nproc} rank(s) trained over NCCL, exit {s['exit_code']}, warm-started ranks {s['warm']}", s


def check_hang(ctx: Context, sync: str = "barrier", nproc: int = NPROC, backend: str | None = None) -> Result:
    rank = nproc - 1
    s = run_job(ctx, f"hang-{sync}", inject=f"hang@{rank}:{FAULT_STEP}", max_restarts=0, sync=sync, nproc=nproc,
                backend=backend, fault_rank=rank)
    hang_seen = (s["first_fault"] or {}).get("fault_kind") == "hang"
    rule = s["decisions"][0]["rule"] if s["decisions"] else None
    # Steps that end in a barrier leave rank 0 waiting inside a collective: the culprit must be named.
    named = sync != "barrier" or nproc == 1 or s["culprit_named"]
    ok = hang_seen and rule == "hang" and s["exit_code"] not in (0, None) and named
    line = (f"{s['backend']} x{nproc}, steps end in {sync}: hang detected {hang_seen}, {s['detection_s']}s after "
            f"the fault; {describe_decision(s)}; exit {s['exit_code']}")
    return bool(ok), line, s


def check_hang_item(ctx: Context) -> Result:
    if ctx.backend == "nccl":
        return check_hang(ctx, sync="item")
    if ctx.device == "cuda":  # one GPU: NCCL takes one rank, so the hang path over NCCL with a single rank
        return check_hang(ctx, sync="item", nproc=1, backend="nccl")
    return True, f"skipped: {ctx.backend}'s all_reduce blocks, so this is the hang check again", {"skip": True}


def check_cuda_assert(ctx: Context) -> Result:
    s = run_job(ctx, "cuda-assert", inject=None, max_restarts=1, assert_step=ASSERT_STEP)
    rule = s["decisions"][0]["rule"] if s["decisions"] else None
    ok = rule == ("cuda-script-error" if ctx.device == "cuda" else "uncaught-exception") and s["exit_code"] == 0
    reason = s["decisions"][0]["reason"] if s["decisions"] else ""
    line = (f"{ctx.backend}: {describe_decision(s)}: {reason[:120]!r}; restore_step {s['restore_step']}, "
            f"exit {s['exit_code']}")
    return ok, line, s


def check_nccl_faults(ctx: Context) -> Result:
    """With one GPU the 2-rank fault checks run gloo: here the CUDA-error and crash paths run
    over NCCL with one rank (the restart builds a new NCCL communicator in a warm fork)."""
    if ctx.backend == "nccl":
        return True, "skipped: the 2-rank checks already run NCCL", {"skip": True}
    backend = "nccl" if ctx.device == "cuda" else "gloo"  # gloo on CPU (--cpu): this script's own test
    asserted = run_job(ctx, "nccl-assert", inject=None, max_restarts=1, assert_step=ASSERT_STEP, nproc=1,
                       backend=backend, fault_rank=0)
    killed = run_job(ctx, "nccl-crash", inject=f"kill@0:{FAULT_STEP}", max_restarts=1, nproc=1, backend=backend,
                     fault_rank=0)
    rule = asserted["decisions"][0]["rule"] if asserted["decisions"] else None
    ok = (rule == ("cuda-script-error" if ctx.device == "cuda" else "uncaught-exception") and asserted["exit_code"] == 0
          and killed["exit_code"] == 0 and killed["restore_step"] is not None)
    line = (f"{backend} x1: device-side assert {describe_decision(asserted)}, restore_step {asserted['restore_step']}, "
            f"exit {asserted['exit_code']}; SIGKILL seen {killed['detection_s']}s after the fault, "
            f"{describe_decision(killed)}, restore_step {killed['restore_step']}, exit {killed['exit_code']}, "
            f"warm-started ranks {killed['warm']}")
    return ok, line, {"assert": asserted, "crash": killed}


def check_crash(ctx: Context) -> Result:
    s = run_job(ctx, "crash", inject=f"kill@1:{FAULT_STEP}", max_restarts=1)
    first = s["first_fault"] or {}
    ok = first.get("rank") == 1 and s["exit_code"] == 0 and s["restore_step"] is not None
    line = (f"{ctx.backend}: rank {first.get('rank')} {first.get('signal') or first.get('fault_kind')} seen "
            f"{s['detection_s']}s after the fault; {describe_decision(s)}; restore_step {s['restore_step']}, "
            f"exit {s['exit_code']}")
    return ok, line, s


def check_snapshot(ctx: Context) -> Result:
    """unicron.State on the GPU: background commits exact, and their cost next to synchronous ones."""
    code, out, err = run_command([sys.executable, str(JOBS / "snapshot_probe.py")], ctx.env, min(ctx.left(), 240),
                                 ctx.work)
    try:
        d = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False, f"snapshot probe exit {code}: {err.strip()[-300:]!r}", {"exit_code": code, "stderr": err[-3000:]}
    ok = code == 0 and all(d.get("exact") or [False])
    ratios = "; ".join(f"batch {r.get('batch')} ({r.get('step_ms', {}).get('none')} ms): synchronous "
                       f"{r.get('ratio_sync')}, background {r.get('ratio_background')}" for r in d.get("runs", []))
    line = (f"{d.get('device')}, {d.get('state_mb')} MB of state: background snapshots exact {d.get('exact')}; "
            f"page-locked slots {d.get('pinned_slots')} {d.get('pin_error')}; steps/s vs no snapshot: {ratios}")
    return ok, line, d


def run_stall_job(ctx: Context, name: str, **kw: Any) -> dict[str, Any]:
    """A rank stalls for real at FAULT_STEP: over NCCL with a rank per GPU (1 on a one-GPU machine:
    its stalled stream holds the step's all_reduce), 2 ranks over gloo on CPU."""
    nproc = NPROC if ctx.backend == "nccl" or ctx.device != "cuda" else 1
    backend = "nccl" if ctx.device == "cuda" else "gloo"
    return run_job(ctx, name, inject=None, max_restarts=1, sync="item", nproc=nproc, backend=backend,
                   fault_rank=nproc - 1, stall="spin", **kw)


def check_gpu_stuck(ctx: Context) -> Result:
    s = run_stall_job(ctx, "gpu-stuck")
    first = s["first_fault"] or {}
    rule = s["decisions"][0]["rule"] if s["decisions"] else None
    nproc = s["nproc"]
    ok = (first.get("fault_kind") == "hang" and rule == "hang" and (nproc == 1 or s["culprit_named"])
          and s["exit_code"] == 0 and s["restore_step"] is not None)
    what = "a kernel spinning on its stream" if ctx.device == "cuda" else "a native call that never returns"
    line = (f"{s['backend']} x{nproc}, rank {nproc - 1} stalled by {what}: hang called {s['detection_s']}s later "
            f"({first.get('message', '')[:90]!r}); {describe_decision(s)}; restore_step {s['restore_step']}, "
            f"exit {s['exit_code']}")
    return ok, line, s


def check_nccl_timeout(ctx: Context) -> Result:
    s = run_stall_job(ctx, "nccl-timeout", flags=LATE_FLOORS, env={"GPU_CHECK_PG_TIMEOUT": str(PG_TIMEOUT_S)})
    first = s["first_fault"] or {}
    rule = s["decisions"][0]["rule"] if s["decisions"] else None
    ok = rule == "collective-timeout" and s["exit_code"] == 0 and s["restore_step"] is not None
    line = (f"{s['backend']}, process group timeout {PG_TIMEOUT_S}s: rank {first.get('rank')} "
            f"{first.get('signal') or first.get('error_type') or first.get('fault_kind')} {s['detection_s']}s after "
            f"the stall; {describe_decision(s)}; restore_step {s['restore_step']}, exit {s['exit_code']}")
    return ok, line, s


def check_nccl_shared_gpu(ctx: Context) -> Result:
    if ctx.device != "cuda":
        return NO_NCCL
    s = run_job(ctx, "nccl-shared-gpu", inject=None, max_restarts=3, sync="item", nproc=NPROC, backend="nccl",
                env={"GPU_CHECK_SAME_GPU": "1"})
    d = s["decisions"][0] if s["decisions"] else {}
    said = [line for line in s["stderr_tail"].splitlines() if "Duplicate GPU" in line][-1:]
    ok = (d.get("rule") == "user-gpu-shared" and d.get("severity") == "FATAL" and s["attempts"] == 1
          and s["exit_code"] not in (0, None))
    line = (f"nccl x{NPROC} on cuda:0: {describe_decision(s)} after {s['attempts']} attempt(s), exit "
            f"{s['exit_code']}; unicron said {said[0].strip()[:160] if said else 'nothing of it'!r}")
    return ok, line, s


CHECK_FUNCS: dict[str, Callable[[Context], Result]] = {
    "pynvml": check_pynvml, "warm": check_warm, "nccl": check_nccl, "hang": check_hang, "hang-item": check_hang_item,
    "cuda-assert": check_cuda_assert, "crash": check_crash, "nccl-faults": check_nccl_faults,
    "snapshot": check_snapshot, "gpu-stuck": check_gpu_stuck, "nccl-timeout": check_nccl_timeout,
    "nccl-shared-gpu": check_nccl_shared_gpu,
}


def run_check(name: str, ctx: Context, timeout_s: float) -> dict[str, Any]:
    """One check in a daemon thread (a driver call that never returns cannot stop the run); never raises."""
    ctx.deadline = time.monotonic() + timeout_s
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["ok"], box["summary"], box["details"] = CHECK_FUNCS[name](ctx)
        except BaseException as exc:  # a failed check is a result, not the end of the run
            box["error"] = "".join(traceback.format_exception(exc))[-4000:]

    t0 = time.monotonic()
    thread = threading.Thread(target=target, name=f"check-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s + STOP_MARGIN_S)
    record: dict[str, Any] = {"name": name, "seconds": round(time.monotonic() - t0, 2)}
    if thread.is_alive():
        record.update(ok=False, error=f"did not finish in {timeout_s + STOP_MARGIN_S:.0f}s (left running)")
    elif "error" in box:
        record.update(ok=False, error=box["error"])
    else:
        skipped = box["details"].get("skip", False)  # ok None: nothing was checked
        record.update(ok=None if skipped else bool(box["ok"]), summary=box["summary"], details=box["details"])
    return record


def write_json(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)


def probe_torch() -> dict[str, Any]:
    """What torch sees; ``cuda`` False (with ``reason``) when it cannot be imported or sees no GPU."""
    try:
        import torch

        info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
                                "cuda": bool(torch.cuda.is_available())}
        if info["cuda"]:
            info["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # no torch, or a broken CUDA setup: still a result
        return {"cuda": False, "reason": f"torch cannot tell: {type(exc).__name__}: {exc}"}
    if not info["cuda"]:
        build = torch.version.cuda or "none, a CPU-only build"
        info["reason"] = f"torch {torch.__version__} (CUDA {build}): torch.cuda.is_available() is False"
        return info
    with contextlib.suppress(Exception):
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="unicron's checks on a GPU machine (see the module docstring)")
    p.add_argument("--out", type=Path, required=True, help="JSON results (rewritten after every check)")
    p.add_argument("--only", help=f"comma-separated checks, of {', '.join(CHECKS)} [all]")
    p.add_argument("--timeout-per-check", type=float, default=90.0, help="seconds for each check [90]")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run [480]")
    p.add_argument("--cpu", action="store_true", help="without CUDA, run the checks on CPU over gloo")
    args = p.parse_args(argv)
    try:
        names = parse_only(args.only)
        if not args.timeout_per_check > 0 or not args.budget > 0:
            raise ValueError("--timeout-per-check and --budget must be positive")
        args.out.parent.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as err:
        print(f"gpu_checks: {err}", file=sys.stderr)
        return 2
    started = time.monotonic()
    result: dict[str, Any] = {"started": time.time(), "finished": False, **probe_torch(), "checks": []}
    if not result["cuda"] and not args.cpu:
        print(f"gpu_checks: no CUDA, no check run: {result['reason']}", flush=True)
        result["finished"] = True
        write_json(args.out, result)
        return 0
    device = "cuda" if result["cuda"] else "cpu"
    backend, why = choose_backend(device, len(result.get("devices", [])), NPROC)
    result.update(device=device, backend=backend, backend_reason=why)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "UNICRON_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", GPU_CHECK_DEVICE=device, GPU_CHECK_BACKEND=backend)
    print(f"gpu_checks: {device} {result.get('devices', [])}, torch {result.get('torch')}, {backend} ({why})",
          flush=True)
    write_json(args.out, result)  # what the machine has, even if the first check never returns
    with tempfile.TemporaryDirectory(prefix="unicron-gpu-checks-", ignore_cleanup_errors=True) as tmp:
        ctx = Context(device=device, backend=backend, device_count=len(result.get("devices", [])), work=Path(tmp),
                      env=env)
        for name in names:
            left = args.budget - (time.monotonic() - started)
            if left < 30:
                record: dict[str, Any] = {"name": name, "ok": False, "seconds": 0.0,
                                          "error": f"not run: {left:.0f}s of the --budget left"}
            else:
                record = run_check(name, ctx, min(args.timeout_per_check, left - STOP_MARGIN_S))
            result["checks"].append(record)
            write_json(args.out, result)
            text = record.get("summary") or (str(record.get("error", "")).strip().splitlines() or [""])[-1]
            status = {True: "ok", False: "FAIL", None: "skip"}[record["ok"]]
            print(f"[{status}] {name} {record['seconds']:.1f}s: {text}", flush=True)
    result.update(finished=True, seconds=round(time.monotonic() - started, 2))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
