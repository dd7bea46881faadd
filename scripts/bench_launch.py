"""Launch time: from the command to every worker's first completed step, unicron vs torchrun.

The clock starts just before the launcher is spawned; a worker's first step is the first line
of its ``--step-log`` file (written right after its first ``optimizer.step()``). Launchers
alternate run by run so drift in machine load hits both alike. Target: ratio <= 1.0.

    .venv/bin/python scripts/bench_launch.py --repeat 5
"""

from __future__ import annotations

import argparse
import sys

from _bench_common import (
    all_ranks_reached,
    command_line,
    fmt_s,
    launched,
    launcher_cmd,
    machine_line,
    markdown_table,
    median,
    pick_launchers,
    ratio,
    wait_for,
    workdir,
)

TRAIN_ARGS = ["--steps", "3", "--batch-size", "4", "--seq-len", "32"]


def launch_once(launcher: str, nproc: int, timeout: float) -> tuple[float | None, float | None]:
    """(seconds to every rank's first step, seconds to a clean exit); None where it never came."""
    work = workdir(f"launch-{launcher}")
    step_dir = work / "steps"
    cmd = launcher_cmd(launcher, [*TRAIN_ARGS, "--step-log", str(step_dir)], nproc=nproc, log_dir=work / "logs")
    with launched([(cmd, work / "launcher.log")]) as (run,):
        reached = wait_for(lambda: all_ranks_reached(step_dir, nproc, 1), timeout)
        exited = wait_for(run.exited_at, timeout)
        assert run.proc is not None
        if reached is None or exited is None or run.proc.returncode != 0:
            print(f"{launcher}: run failed (rc={run.proc.returncode}); output tail:\n{run.tail()}", file=sys.stderr)
        first = None if reached is None else reached - run.started_at
        done = None if exited is None or run.proc.returncode != 0 else exited - run.started_at
    return first, done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds one launch may take")
    ap.add_argument("--only", choices=["torchrun", "unicron"])
    args = ap.parse_args()
    launchers = pick_launchers(args.only)
    firsts: dict[str, list[float]] = {name: [] for name in launchers}
    exits: dict[str, list[float]] = {name: [] for name in launchers}
    for i in range(args.repeat):
        order = launchers if i % 2 == 0 else launchers[::-1]
        for launcher in order:
            first, done = launch_once(launcher, args.nproc, args.timeout)
            print(f"run {i + 1}/{args.repeat} {launcher}: first step {fmt_s(first)}, exit {fmt_s(done)}",
                  file=sys.stderr, flush=True)
            if first is not None:
                firsts[launcher].append(first)
            if done is not None:
                exits[launcher].append(done)

    rows = []
    for launcher in launchers:
        rows.append([launcher, f"{len(firsts[launcher])}/{args.repeat}", fmt_s(median(firsts[launcher])),
                     fmt_s(min(firsts[launcher], default=None)), fmt_s(median(exits[launcher]))])
    print(f"Command: `{command_line()}`  \nMachine: {machine_line()}, {args.nproc} workers\n")
    print(markdown_table(["launcher", "ok runs", "median to every first step", "best", "median to exit"], rows))
    u = median(firsts.get("unicron", []))
    t = median(firsts.get("torchrun", []))
    print(f"\nratio unicron/torchrun (median to every first step): {ratio(u, t)}  (target <= 1.0)")


if __name__ == "__main__":
    main()
