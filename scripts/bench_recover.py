"""Recovery: fault to next completed step, and steps lost, unicron vs torchrun.

Rank 1 of a 2-worker job SIGKILLs itself at the start of step ``--fault-step``. Compared:

* ``unicron``: ``unicron run --max-restarts 3``; the script's worker API (``unicron.State``)
  snapshots every step, so the restarted workers continue from memory, no disk checkpoint.
* ``torchrun (restart)``: ``torchrun --max-restarts 3`` with a disk checkpoint every
  ``--ckpt-every`` steps (the script resumes from the newest one).
* ``torchrun (resubmit)``: the same job relaunched the moment torchrun exits (a scheduler with
  zero queue wait), resuming from the disk checkpoint. This is the baseline that works where
  torchrun's own restarts do not (on torch 2.13 with gloo they reuse stale store keys).

From the ``--step-log`` files: *next step* is fault -> every rank has completed a step again;
*progress back* is fault -> every rank is past the last step completed before the fault;
*steps lost* = last step completed before the fault - step the run resumed from. Each run's
final parameters are compared with a failure-free run (2 ranks with DDP resume bit for bit).
Target: unicron at least 5x faster to the next step, at most 1 step lost.

    .venv/bin/python scripts/bench_recover.py
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from _bench_common import (
    Launched,
    all_ranks_reached,
    command_line,
    launched,
    launcher_cmd,
    machine_line,
    markdown_table,
    pick_launchers,
    read_stamp,
    read_step_logs,
    wait_for,
    workdir,
)

SIDES = {"unicron": "unicron", "torchrun-restart": "torchrun", "torchrun-resubmit": "torchrun"}
SHA = re.compile(r"sha256 ([0-9a-f]{64})")


@dataclass
class Recovery:
    ok: bool
    next_step_s: float | None = None
    progress_back_s: float | None = None
    steps_lost: int | None = None
    exact: bool | None = None
    note: str = ""


def train_args(args: argparse.Namespace, step_dir: Path, extra: list[str]) -> list[str]:
    return ["--steps", str(args.steps), "--batch-size", "4", "--seq-len", "32",
            "--step-log", str(step_dir), *extra]


def final_sha(run: Launched) -> str | None:
    for _, line in reversed(run.lines):
        if m := SHA.search(line):
            return m.group(1)
    return None


def run_to_end(run: Launched, timeout: float) -> bool:
    ok = wait_for(run.exited_at, timeout) is not None
    return ok and run.proc is not None and run.proc.returncode == 0


def reference_sha(args: argparse.Namespace) -> str | None:
    """Final parameters of a failure-free run (torchrun, same world size and data)."""
    work = workdir("recover-ref")
    cmd = launcher_cmd("torchrun", train_args(args, work / "steps", []), nproc=2)
    with launched([(cmd, work / "launcher.log")]) as (run,):
        if not run_to_end(run, args.timeout):
            print(f"reference run failed:\n{run.tail()}", file=sys.stderr)
            return None
        return final_sha(run)


def measure(side: str, args: argparse.Namespace, ref: str | None) -> Recovery:
    work = workdir(f"recover-{side}")
    step_dir, stamp, ckpt = work / "steps", work / "fault.txt", work / "ckpt"
    fault = ["--fault", f"kill@1:{args.fault_step}", "--fault-stamp", str(stamp)]
    disk = [] if side == "unicron" else ["--ckpt-dir", str(ckpt), "--ckpt-every", str(args.ckpt_every)]
    restarts = 0 if side == "torchrun-resubmit" else 3
    cmd = launcher_cmd(SIDES[side], train_args(args, step_dir, [*fault, *disk]), nproc=2,
                       max_restarts=restarts, log_dir=work / "logs")
    with launched([(cmd, work / "launcher.log")]) as (run,):
        finished = run_to_end(run, args.timeout)
        last_run = run
        if side == "torchrun-resubmit" and read_stamp(stamp) is not None:
            again = launcher_cmd("torchrun", train_args(args, step_dir, disk), nproc=2, log_dir=work / "logs2")
            with launched([(again, work / "launcher2.log")]) as (rerun,):
                finished = run_to_end(rerun, args.timeout)
                last_run = rerun
                return summarize(step_dir, stamp, finished, last_run, ref)
        return summarize(step_dir, stamp, finished, last_run, ref)


def summarize(step_dir: Path, stamp: Path, finished: bool, run: Launched, ref: str | None) -> Recovery:
    fault_ts = read_stamp(stamp)
    if fault_ts is None:
        return Recovery(False, note="the fault never happened")
    logs = read_step_logs(step_dir)
    before = [max((r.step for r in recs if r.ts < fault_ts), default=0) for recs in logs.values()]
    after = [r.step for recs in logs.values() for r in recs if r.ts > fault_ts]
    # the furthest any rank got: the faulty rank logs its last step before its stamp, a peer may
    # log the same step a moment after it
    last_before = max(before) if before else 0
    next_at = all_ranks_reached(step_dir, 2, 0, after=fault_ts)
    back_at = all_ranks_reached(step_dir, 2, last_before + 1, after=fault_ts)
    sha = final_sha(run)
    return Recovery(
        ok=finished,
        next_step_s=None if next_at is None else next_at - fault_ts,
        progress_back_s=None if back_at is None else back_at - fault_ts,
        steps_lost=(last_before - (min(after) - 1)) if after else None,
        exact=None if sha is None or ref is None else sha == ref,
        note="" if finished else exit_note(run),
    )


def exit_note(run: Launched) -> str:
    rc = None if run.proc is None else run.proc.poll()
    return "timed out" if rc is None else f"exit code {rc}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fault-step", type=int, default=26, help="rank 1 is killed at the start of this step")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun's disk checkpoint interval")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=90.0, help="longest wait for one launch to finish")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {', '.join(SIDES)}")
    args = ap.parse_args()
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if bad := [s for s in sides if s not in SIDES]:
        ap.error(f"unknown side(s) {', '.join(bad)}; expected {', '.join(SIDES)}")
    if "unicron" in sides and "unicron" not in pick_launchers("unicron"):
        sides.remove("unicron")
    if not 1 < args.fault_step <= args.steps:
        ap.error("--fault-step must be within 2..--steps")

    ref = reference_sha(args)
    results: dict[str, list[Recovery]] = {s: [] for s in sides}
    for i in range(args.repeat):
        for side in sides if i % 2 == 0 else sides[::-1]:
            rec = measure(side, args, ref)
            results[side].append(rec)
            print(f"run {i + 1}/{args.repeat} {side}: {rec}", file=sys.stderr, flush=True)

    rows = [[side, *cells(results[side])] for side in sides]
    print(f"Command: `{command_line()}`  \nMachine: {machine_line()}; 2 workers, {args.steps} steps, "
          f"rank 1 killed at step {args.fault_step}, torchrun checkpoints every {args.ckpt_every} steps; "
          f"median of {args.repeat} run(s)\n")
    print(markdown_table(["side", "recovered", "fault -> next step", "fault -> progress back", "steps lost",
                          "final model == failure-free"], rows))
    u = med([r.next_step_s for r in results.get("unicron", [])])
    for side in ("torchrun-restart", "torchrun-resubmit"):
        t = med([r.next_step_s for r in results.get(side, [])])
        if u is not None and t is not None and u > 0:
            print(f"\nspeed-up to next step, unicron vs {side} (medians of recovered runs): {t / u:.1f}x"
                  "  (target >= 5x)")


def med(values: list[float | None]) -> float | None:
    """Median over the runs that recovered (the "recovered" column says how many did)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def cells(recs: list[Recovery]) -> list[str]:
    ok = sum(r.ok for r in recs)
    nxt, back = med([r.next_step_s for r in recs]), med([r.progress_back_s for r in recs])
    lost = [r.steps_lost for r in recs if r.steps_lost is not None]
    exact = [r.exact for r in recs if r.exact is not None]
    return [
        f"{ok}/{len(recs)}" + ("" if ok == len(recs) else " (" + "; ".join(r.note for r in recs if r.note) + ")"),
        "n/a" if nxt is None else f"{nxt:.2f} s",
        "n/a" if back is None else f"{back:.2f} s",
        "n/a" if not lost else str(max(lost)),
        "n/a" if not exact else ("yes" if all(exact) else f"no ({exact.count(False)}/{len(exact)})"),
    ]


if __name__ == "__main__":
    main()
