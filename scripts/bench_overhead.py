"""Failure-free throughput: steps per second under unicron vs torchrun, same script and flags.

Under unicron the workers carry everything unicron adds (the injected step hooks, the agent
channel, a ``unicron.State`` snapshot after every step: synchronous for this CPU job, see
``unicron/worker/state.py``); under torchrun
``commit()`` is a no-op. The rate is taken from rank 0's ``--step-log`` between step
``--warmup`` and the last step, so start-up is excluded. Launchers alternate run by run.
Target: unicron within 1% of torchrun (ratio >= 0.99).

This machine's speed drifts by several percent within minutes, so every repeat runs each side
once, back to back, and the ratio reported is the median of the per-repeat ratios (each side /
torchrun of the same repeat): a slow minute slows both sides of its pair. Beside steps/s the
benchmark measures *CPU per step*: the user+system CPU of every process of the job (launcher,
agent, coordinator, workers) between the step ``--warmup`` and step ``--steps - 5``, sampled from
``/proc`` when rank 0 logs those steps, divided by the steps in between. On a CPU-bound job it is
what unicron adds, and unlike steps/s it does not move when another tenant takes the cores.
*Launcher CPU per step* is the part of it spent in the launcher process alone (torchrun's agent;
unicron's agent and embedded coordinator): the cost of supervision itself, which the ranks pay
where they share the launcher's cores.

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
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from _bench_common import (
    Launched,
    command_line,
    launched,
    launcher_cmd,
    machine_line,
    markdown_table,
    pick_launchers,
    read_step_logs,
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


@dataclass
class Run:
    rate: float | None  # steps/s of rank 0 after warm-up
    cpu: float  # CPU seconds of the whole job, start-up included
    cpu_per_step: float | None  # CPU seconds of the whole job per step, in the steady window
    launcher_per_step: float | None = None  # ... of the launcher process alone (agent, coordinator)


def tree_cpu(run: Launched) -> tuple[float, float]:
    """user+system CPU seconds of the launcher and every live descendant, and of the launcher
    process alone (torchrun's agent; unicron's agent and embedded coordinator), now."""
    total = launcher = 0.0
    for i, proc in enumerate(run.tree()):
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system
        if i == 0:
            launcher = t.user + t.system
    return total, launcher


def last_step(path: Path) -> int:
    """The newest step in a step log (0 before the first); reads only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 256))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        parts = line.split()
        if len(parts) == 3 and parts[0].isdigit():
            return int(parts[0])
    return 0


def measure(side: str, args: argparse.Namespace) -> Run:
    launcher, launcher_flags, extra = SIDES[side]
    work = workdir(f"overhead-{side}")
    step_dir = work / "steps"
    train = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--step-log", str(step_dir), *extra]
    cmd = launcher_cmd(launcher, train, nproc=args.nproc, log_dir=work / "logs", extra=launcher_flags)
    cpu_end_step = args.steps - 5
    samples: list[tuple[int, tuple[float, float]]] = []  # (step rank 0 had logged, tree_cpu then)
    cpu_before = children_cpu()
    with launched([(cmd, work / "launcher.log")]) as (run,):
        deadline = time.monotonic() + args.timeout
        while run.exited_at() is None and time.monotonic() < deadline:
            wanted = args.warmup if not samples else cpu_end_step if len(samples) == 1 else None
            if wanted is not None and (step := last_step(step_dir / "rank0.txt")) >= wanted:
                samples.append((step, tree_cpu(run)))
            time.sleep(0.02)
        assert run.proc is not None
        failed = run.exited_at() is None or run.proc.returncode != 0
        if failed:
            print(f"{side}: run failed (rc={run.proc.returncode}):\n{run.tail()}", file=sys.stderr)
    cpu = children_cpu() - cpu_before
    if failed:
        return Run(None, cpu, None)
    recs = {r.step: r.ts for r in read_step_logs(step_dir).get(0, [])}
    if args.warmup not in recs or args.steps not in recs:
        print(f"{side}: step log incomplete", file=sys.stderr)
        return Run(None, cpu, None)
    per_step = launcher_per_step = None
    if len(samples) == 2 and samples[1][0] > samples[0][0]:
        steps = samples[1][0] - samples[0][0]
        per_step = (samples[1][1][0] - samples[0][1][0]) / steps
        launcher_per_step = (samples[1][1][1] - samples[0][1][1]) / steps
    return Run((args.steps - args.warmup) / (recs[args.steps] - recs[args.warmup]), cpu, per_step,
               launcher_per_step)


def paired(runs: dict[str, list[Run]], side: str, field: str, invert: bool = False) -> list[float]:
    """Per-repeat ratios side/torchrun of `field` (torchrun/side with `invert`), both present."""
    out = []
    for mine, theirs in zip(runs[side], runs["torchrun"], strict=True):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a and b:
            out.append(b / a if invert else a / b)
    return out


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
    runs: dict[str, list[Run]] = {x: [] for x in sides}
    for i in range(args.repeat):
        for side in sides if i % 2 == 0 else sides[::-1]:
            run = measure(side, args)
            runs[side].append(run)
            per_step = "n/a" if run.cpu_per_step is None else f"{run.cpu_per_step * 1e3:.1f} ms"
            if run.launcher_per_step is not None:
                per_step += f" (launcher {run.launcher_per_step * 1e3:.2f} ms)"
            print(f"run {i + 1}/{args.repeat} {side}: "
                  f"{'failed' if run.rate is None else f'{run.rate:.2f} steps/s'}, job CPU {run.cpu:.1f} s, "
                  f"CPU per step {per_step}", file=sys.stderr, flush=True)

    def med(values: list[float], fmt: str, scale: float = 1.0) -> str:
        return format(statistics.median(values) * scale, fmt) if values else "n/a"

    rows = []
    for side in sides:
        r = [x.rate for x in runs[side] if x.rate is not None]
        c = [x.cpu for x in runs[side] if x.rate is not None]
        p = [x.cpu_per_step for x in runs[side] if x.cpu_per_step is not None]
        lp = [x.launcher_per_step for x in runs[side] if x.launcher_per_step is not None]
        rows.append([side, f"{len(r)}/{args.repeat}", med(r, ".2f"),
                     f"{min(r):.2f} .. {max(r):.2f}" if r else "n/a",
                     f"{1e3 / statistics.median(r):.1f} ms" if r else "n/a",
                     med(p, ".1f", 1e3) + (" ms" if p else ""), med(lp, ".2f", 1e3) + (" ms" if lp else ""),
                     med(c, ".1f") + (" s" if c else "")])
    print(f"Command: `{command_line()}`  \nMachine: {machine_line()}; {args.nproc} workers, "
          f"steps {args.warmup}..{args.steps} of batch {args.batch_size} x {args.seq_len} chars; "
          f"{args.repeat} repeat(s), sides back to back in each\n")
    print(markdown_table(["side", "ok runs", "median steps/s", "range", "median step", "job CPU per step",
                          "launcher CPU per step", "job CPU (whole run)"], rows))
    if "torchrun" not in sides:
        return
    for side in [x for x in sides if x != "torchrun"]:
        speed = paired(runs, side, "rate")
        cpu = paired(runs, side, "cpu_per_step", invert=True)
        if speed:
            print(f"\n{side}/torchrun, median of {len(speed)} paired repeat(s): steps/s **{statistics.median(speed):.3f}** "
                  f"(range {min(speed):.3f} .. {max(speed):.3f}); "
                  + (f"CPU per step (torchrun's / {side}'s) **{statistics.median(cpu):.3f}** "
                     f"(range {min(cpu):.3f} .. {max(cpu):.3f})" if cpu else "CPU per step n/a")
                  + "  (target >= 0.99)")


if __name__ == "__main__":
    main()
