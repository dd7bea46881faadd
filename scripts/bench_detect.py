"""Detection time of each fault kind, unicron vs torchrun, on the same training script.

Faults (each happens for real, on rank 1 / node 1, after warm-up):

* ``crash``: the worker SIGKILLs itself.            * ``exception``: it raises a CUDA-like error.
* ``hang``: it sleeps forever; its peer blocks in the next all-reduce.
* ``node-kill``: a 2-agent job (1 worker each); the whole second agent (launcher and worker)
  is SIGKILLed. On one machine the kernel closes its sockets, so peers see the loss at once.
* ``node-freeze``: the same, SIGSTOP instead: nothing closes, like a node that lost power or
  network. Peers only notice by missing heartbeats or timeouts.

The fault time is what the worker wrote to ``--fault-stamp`` just before failing (or, for the
node kinds, the benchmark's clock just before the signal). unicron's detection time is the first
``fault`` event in its events.jsonl at or after it; torchrun's is the first time it shows that it
noticed: its "failed (exitcode" log line or its exit. Waits are capped (``--cap``) and reported as
"> cap". Targets: crash or exception < 1 s, hang < max(3 x median step, 2 s), lost node < 3 s.

    .venv/bin/python scripts/bench_detect.py
"""

from __future__ import annotations

import argparse
import secrets
import shlex
import signal
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _bench_common import (
    Launched,
    all_ranks_reached,
    command_line,
    first_event,
    free_port,
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

SCRIPT_FAULTS = {"crash": "kill", "exception": "exception", "hang": "hang"}
NODE_FAULTS = {"node-kill": signal.SIGKILL, "node-freeze": signal.SIGSTOP}
ALL_KINDS = [*SCRIPT_FAULTS, *NODE_FAULTS]
TRAIN_ARGS = ["--steps", "100000", "--batch-size", "4", "--seq-len", "32"]
TORCHRUN_NOTICED = r"failed \(exitcode|Worker group FAILED|ChildFailedError|Restarting worker group"
TARGETS = {"crash": "< 1 s", "exception": "< 1 s", "hang": "< max(3 x median step, 2 s)",
           "node-kill": "< 3 s", "node-freeze": "< 3 s"}


@dataclass
class Outcome:
    detected_s: float | None  # None: not seen within the cap
    cap_s: float
    median_step_s: float | None = None
    note: str = ""

    def cell(self) -> str:
        if self.detected_s is None:
            return f"> {self.cap_s:.0f} s" + (f" ({self.note})" if self.note else "")
        return f"{self.detected_s:.3f} s"


def last_words(run: Launched) -> str:
    """The launcher's last output line, safe inside a markdown table cell."""
    words = run.tail(1).replace("|", "/").strip() or "no output"
    return f"last output: {words[:160]}"


def noticed_at(launcher: str, run: Launched, log_dir: Path, kinds: set[str], after: float) -> float | None:
    if launcher == "unicron":
        event = first_event(log_dir, kinds, after)
        return None if event is None else float(event["ts"])
    line = run.first_line(TORCHRUN_NOTICED, after)
    exit_ts = run.exited_at()
    seen = [t for t in (line, exit_ts) if t is not None and t >= after]
    return min(seen) if seen else None


def median_step(step_dir: Path) -> float | None:
    """Median time between consecutive completed steps of rank 0 before the fault."""
    recs = read_step_logs(step_dir).get(0, [])
    gaps = [b.ts - a.ts for a, b in zip(recs, recs[1:], strict=False) if b.step == a.step + 1]
    return statistics.median(gaps) if gaps else None


def script_fault(launcher: str, kind: str, args: argparse.Namespace, kinds: set[str]) -> Outcome:
    work = workdir(f"detect-{launcher}-{kind}")
    stamp, step_dir, log_dir = work / "fault.txt", work / "steps", work / "logs"
    train = [*TRAIN_ARGS, "--fault", f"{SCRIPT_FAULTS[kind]}@1:{args.fault_step}", "--fault-stamp", str(stamp),
             "--step-log", str(step_dir)]
    cmd = launcher_cmd(launcher, train, nproc=2, log_dir=log_dir, extra=launcher_flags(launcher, args))
    with launched([(cmd, work / "launcher.log")]) as (run,):
        wait_for(lambda: read_stamp(stamp) or run.exited_at(), args.start_timeout)
        fault_ts = read_stamp(stamp)
        if fault_ts is None:
            return Outcome(None, args.cap, note=f"fault never happened; {last_words(run)}")
        seen = wait_for(lambda: noticed_at(launcher, run, log_dir, kinds, fault_ts), args.cap)
        return Outcome(None if seen is None else seen - fault_ts, args.cap, median_step(step_dir))


def node_fault(launcher: str, kind: str, args: argparse.Namespace, kinds: set[str]) -> Outcome:
    work = workdir(f"detect-{launcher}-{kind}")
    step_dir = work / "steps"
    port = free_port()
    cmds = []
    for node in range(2):
        cmd = launcher_cmd(launcher, [*TRAIN_ARGS, "--step-log", str(step_dir)], nproc=1, nnodes=2,
                           node_rank=node, endpoint=f"127.0.0.1:{port}", log_dir=work / f"logs{node}",
                           extra=launcher_flags(launcher, args))
        cmds.append((cmd, work / f"launcher{node}.log"))
    # one worker per agent: torchrun would leave OMP threads at the default and oversubscribe 2 cores;
    # a multi-node unicron job needs one secret on every node
    env = {"OMP_NUM_THREADS": "1", "UNICRON_SECRET": secrets.token_hex(16)}
    # The survivor starts first so that it, not the victim, hosts the rendezvous store (torchrun)
    # or the coordinator (unicron): the lost node is an ordinary member, not the job's hub.
    with launched(cmds[:1], env=env) as (survivor,):
        if wait_for(lambda: port_open(port) or survivor.exited_at(), args.start_timeout) is None or not port_open(port):
            return Outcome(None, args.cap, note=f"first node never listened; {last_words(survivor)}")
        with launched(cmds[1:], env=env) as (victim,):
            reached = wait_for(lambda: all_ranks_reached(step_dir, 2, args.fault_step)
                               or survivor.exited_at() or victim.exited_at(), args.start_timeout)
            if reached is None or all_ranks_reached(step_dir, 2, args.fault_step) is None:
                return Outcome(None, args.cap, note=f"job never reached step {args.fault_step}; {last_words(survivor)}")
            fault_ts = time.time()
            victim.signal_tree(NODE_FAULTS[kind])
            seen = wait_for(lambda: noticed_at(launcher, survivor, work / "logs0", kinds, fault_ts), args.cap)
            return Outcome(None if seen is None else seen - fault_ts, args.cap, median_step(step_dir))


def launcher_flags(launcher: str, args: argparse.Namespace) -> list[str]:
    return shlex.split(args.unicron_flags) if launcher == "unicron" else []


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--kinds", default=",".join(ALL_KINDS), help=f"comma list of {', '.join(ALL_KINDS)}")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--fault-step", type=int, default=10, help="step at which the fault happens (after warm-up)")
    ap.add_argument("--cap", type=float, default=20.0, help="longest wait for a detection, seconds")
    ap.add_argument("--start-timeout", type=float, default=120.0, help="longest wait for the fault to happen")
    ap.add_argument("--event-kinds", default="fault,node_lost", help="unicron event kinds that count as detection")
    ap.add_argument("--unicron-flags", default="", help="extra `unicron run` flags, e.g. '--hang-floor 2'")
    ap.add_argument("--only", choices=["torchrun", "unicron"])
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ALL_KINDS]
    if bad:
        ap.error(f"unknown fault kind(s) {', '.join(bad)}; expected {', '.join(ALL_KINDS)}")
    event_kinds = {k.strip() for k in args.event_kinds.split(",") if k.strip()}
    launchers = pick_launchers(args.only)

    results: dict[tuple[str, str], list[Outcome]] = {}
    for i in range(args.repeat):
        for kind in kinds:
            order = launchers if i % 2 == 0 else launchers[::-1]
            for launcher in order:
                run = node_fault if kind in NODE_FAULTS else script_fault
                out = run(launcher, kind, args, event_kinds)
                results.setdefault((kind, launcher), []).append(out)
                print(f"run {i + 1}/{args.repeat} {kind} {launcher}: {out.cell()}", file=sys.stderr, flush=True)

    rows = []
    for kind in kinds:
        cells = {name: summarize(results.get((kind, name), [])) for name in launchers}
        row = [kind, *(cells[name][0] for name in launchers)]
        if len(launchers) == 2:
            row.append(detect_ratio(cells["unicron"][1], cells["torchrun"][1]))
        steps = [o.median_step_s for name in launchers for o in results.get((kind, name), []) if o.median_step_s]
        row += [f"{statistics.median(steps) * 1e3:.0f} ms" if steps else "n/a", TARGETS[kind]]
        rows.append(row)
    headers = ["fault", *launchers, *(["ratio unicron/torchrun"] if len(launchers) == 2 else []),
               "median step", "target (unicron)"]
    print(f"Command: `{command_line()}`  \nMachine: {machine_line()}; median of {args.repeat} run(s), "
          f"detection waits capped at {args.cap:.0f} s\n")
    print(markdown_table(headers, rows))


def summarize(outcomes: list[Outcome]) -> tuple[str, Outcome | None]:
    """Median detection when every run detected; otherwise the capped cell."""
    if not outcomes:
        return "not run", None
    if any(o.detected_s is None for o in outcomes):
        worst = next(o for o in outcomes if o.detected_s is None)
        return worst.cell(), worst
    med = statistics.median(o.detected_s for o in outcomes if o.detected_s is not None)
    return f"{med:.3f} s", Outcome(med, outcomes[0].cap_s)


def detect_ratio(u: Outcome | None, t: Outcome | None) -> str:
    if u is None or t is None or u.detected_s is None:
        return "n/a"
    if t.detected_s is None:
        return f"< {u.detected_s / t.cap_s:.3f}"
    return f"{u.detected_s / t.detected_s:.3f}" if t.detected_s > 0 else "n/a"


if __name__ == "__main__":
    main()
