"""Failure-free throughput: steps per second under unicron vs torchrun, same script and flags.

Under unicron the workers carry everything unicron adds (the injected step hooks, the agent
channel, a ``unicron.State`` snapshot after every step: synchronous for this CPU job, see
``unicron/worker/state.py``); under torchrun
``commit()`` is a no-op. The rate is taken from rank 0's ``--step-log`` between step
``--warmup`` and the last step, so start-up is excluded. Launchers alternate run by run.
Target: unicron within 1% of torchrun (ratio >= 0.99).

Optional sides split unicron's cost by part: ``unicron-no-state`` (the script's ``--no-state``:
no per-step snapshot), ``unicron-no-warm`` (``unicron run --no-warm``: workers not forked from a
warm interpreter) and ``unicron-no-inject`` (``--no-inject``: workers started as torchrun does). The CPU
column is the user+system time of the whole job (launcher, agent, workers, helpers, start-up
included), taken from getrusage of the reaped children: it is less sensitive than steps/s to
other load on the machine.

    .venv/bin/python scripts/bench_overhead.py --repeat 3
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys

from _bench_common import (
    command_line,
    launched,
    launcher_cmd,
    machine_line,
    markdown_table,
    pick_launchers,
    read_step_logs,
    wait_for,
    workdir,
)

# side -> (launcher, launcher flags, script flags); the last three split unicron's cost by part
SIDES: dict[str, tuple[str, list[str], list[str]]] = {
    "torchrun": ("torchrun", [], []),
    "unicron": ("unicron", [], []),
    "unicron-no-state": ("unicron", [], ["--no-state"]),
    "unicron-no-warm": ("unicron", ["--no-warm"], []),
    "unicron-no-inject": ("unicron", ["--no-inject"], []),
}


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def steps_per_second(side: str, args: argparse.Namespace) -> tuple[float | None, float]:
    """(steps/s of rank 0 after warm-up, CPU seconds of the whole job)."""
    launcher, launcher_flags, extra = SIDES[side]
    work = workdir(f"overhead-{side}")
    step_dir = work / "steps"
    train = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--step-log", str(step_dir), *extra]
    cmd = launcher_cmd(launcher, train, nproc=args.nproc, log_dir=work / "logs", extra=launcher_flags)
    cpu_before = children_cpu()
    with launched([(cmd, work / "launcher.log")]) as (run,):
        exited = wait_for(run.exited_at, args.timeout, interval=0.1)
        assert run.proc is not None
        failed = exited is None or run.proc.returncode != 0
        if failed:
            print(f"{side}: run failed (rc={run.proc.returncode}):\n{run.tail()}", file=sys.stderr)
    cpu = children_cpu() - cpu_before
    if failed:
        return None, cpu
    recs = {r.step: r.ts for r in read_step_logs(step_dir).get(0, [])}
    if args.warmup not in recs or args.steps not in recs:
        print(f"{side}: step log incomplete", file=sys.stderr)
        return None, cpu
    return (args.steps - args.warmup) / (recs[args.steps] - recs[args.warmup]), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20, help="steps excluded from the rate")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=150.0, help="longest wait for one run")
    ap.add_argument("--sides", default="torchrun,unicron", help=f"comma list of {', '.join(SIDES)}")
    args = ap.parse_args()
    if not 0 < args.warmup < args.steps:
        ap.error("need 0 < --warmup < --steps")
    sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    if bad := [x for x in sides if x not in SIDES]:
        ap.error(f"unknown side(s) {', '.join(bad)}; expected {', '.join(SIDES)}")
    if any(SIDES[x][0] == "unicron" for x in sides) and "unicron" not in pick_launchers("unicron"):
        sides = [x for x in sides if SIDES[x][0] != "unicron"]
    rates: dict[str, list[float]] = {x: [] for x in sides}
    cpus: dict[str, list[float]] = {x: [] for x in sides}
    for i in range(args.repeat):
        for side in sides if i % 2 == 0 else sides[::-1]:
            rate, cpu = steps_per_second(side, args)
            print(f"run {i + 1}/{args.repeat} {side}: "
                  f"{'failed' if rate is None else f'{rate:.2f} steps/s'}, job CPU {cpu:.1f} s",
                  file=sys.stderr, flush=True)
            if rate is not None:
                rates[side].append(rate)
                cpus[side].append(cpu)

    rows = []
    for side in sides:
        r, c = rates[side], cpus[side]
        rows.append([side, f"{len(r)}/{args.repeat}",
                     f"{statistics.median(r):.2f}" if r else "n/a",
                     f"{min(r):.2f} .. {max(r):.2f}" if r else "n/a",
                     f"{1e3 / statistics.median(r):.1f} ms" if r else "n/a",
                     f"{statistics.median(c):.1f} s" if c else "n/a"])
    print(f"Command: `{command_line()}`  \nMachine: {machine_line()}; {args.nproc} workers, "
          f"steps {args.warmup}..{args.steps} of batch {args.batch_size} x {args.seq_len} chars; "
          f"median of {args.repeat} run(s)\n")
    print(markdown_table(["side", "ok runs", "median steps/s", "range", "median step", "job CPU (median)"], rows))
    t = rates.get("torchrun")
    for side in [x for x in sides if x != "torchrun"]:
        u = rates.get(side)
        if u and t:
            print(f"\nratio {side}/torchrun (steps/s): {statistics.median(u) / statistics.median(t):.3f}"
                  "  (target >= 0.99)")


if __name__ == "__main__":
    main()
