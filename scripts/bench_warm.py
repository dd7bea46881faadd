"""What warm starts save: spawn -> first line of user code, and -> first gloo all_reduce, cold vs warm.

A restart starts every local rank at once. Cold: ``start_worker`` (a new interpreter per rank
that imports torch when the script does). Warm: ``WarmPool.take`` sends the same command,
environment and log files to the zygote, which imported torch once and forks each rank (this
process is made a child subreaper, as the agent is). The zygote is ready before anything is
timed (as in a job: it imports while the job forms), then the cold attempt and the warm attempt run one
after the other on a quiet machine, each a real ``nproc``-rank gloo job whose ranks rendezvous
through a TCPStore hosted here (a fresh store per attempt, as torchelastic's agent does).

The script each rank runs stamps ``time.time()`` on its first line, then imports torch, joins
the process group and all-reduces once. Times are from just before the first rank is spawned
(or taken) to the *last* rank reaching each point: the job can only go on when all have.

    .venv/bin/python scripts/bench_warm.py --repeats 5 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from unicron.agent.logs import RankLogs  # noqa: E402
from unicron.agent.procs import WorkerProcess, start_worker  # noqa: E402
from unicron.agent.signals import set_child_subreaper  # noqa: E402
from unicron.agent.terminate import terminate_all  # noqa: E402
from unicron.agent.warm import WarmPool  # noqa: E402

RANK_SCRIPT = """
    import time
    first_line = time.time()
    import json, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.ones(4)
    dist.all_reduce(t)
    reduced = time.time()
    assert t[0].item() == dist.get_world_size()
    dist.destroy_process_group()
    with open(sys.argv[1], "w") as fh:
        json.dump({"first_line": first_line, "reduced": reduced}, fh)
"""
TIMEOUT_S = 180.0


def worker_env(store_port: int, rank: int, nproc: int, attempt: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNICRON_", "TORCHELASTIC_"))}
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port), "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    })
    return env


def run_attempt(pool: WarmPool | None, *, script: Path, workdir: Path, nproc: int,
                attempt: int) -> dict[str, float]:
    """One nproc-rank job; seconds from spawn to the last rank's first line and all_reduce."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    store_port = store.port
    attempt_dir = workdir / f"attempt_{attempt}"
    procs: list[WorkerProcess] = []
    stamps = []
    try:
        plans = []
        for rank in range(nproc):
            directory = attempt_dir / str(rank)
            directory.mkdir(parents=True)
            plans.append(RankLogs(rank, rank, str(directory), str(directory / "stdout.log"),
                                  str(directory / "stderr.log"), False, False, str(directory / "error.json"), ""))
        spawned = time.time()
        for rank, plan in enumerate(plans):
            stamp = attempt_dir / f"stamp{rank}.json"
            stamps.append(stamp)
            cmd = [sys.executable, "-u", "-m", "unicron.worker.boot", str(script), str(stamp)]
            env = worker_env(store_port, rank, nproc, attempt)
            proc = pool.take(cmd, env, plan) if pool is not None else start_worker(cmd, env, plan)
            if proc is None:
                raise SystemExit(f"bench_warm: the pool started rank {rank} cold: {pool and pool.last_miss}")
            procs.append(proc)
        for proc, plan in zip(procs, plans, strict=True):
            code = proc.popen.wait(TIMEOUT_S)
            if code != 0:
                raise SystemExit(f"bench_warm: rank {proc.rank} exited {code}:\n"
                                 + Path(plan.stderr_path or "").read_text()[-2000:])
    finally:
        terminate_all(procs, 1.0)
        del store
    seen = [json.loads(s.read_text()) for s in stamps]
    return {"first_line": max(s["first_line"] for s in seen) - spawned,
            "all_reduce": max(s["reduced"] for s in seen) - spawned}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    def cell(mode: str, key: str) -> str:
        values = [r[key] for r in results[mode]]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    rows = ["| spawn to (last rank) | cold, s: median (min-max) | warm, s: median (min-max) | cold / warm |",
            "|---|---|---|---|"]
    for key, what in (("first_line", "first line of user code"), ("all_reduce", "first gloo all_reduce done")):
        cold = statistics.median(r[key] for r in results["cold"])
        warm = statistics.median(r[key] for r in results["warm"])
        rows.append(f"| {what} | {cell('cold', key)} | {cell('warm', key)} | {cold / warm:.1f}x |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, help="ranks per attempt")
    args = parser.parse_args()
    if args.repeats < 1 or args.nproc < 1:
        parser.error("--repeats and --nproc must be >= 1")

    results: dict[str, list[dict[str, float]]] = {"cold": [], "warm": []}
    set_child_subreaper(True)  # forked ranks are re-parented to us, as to the agent
    with tempfile.TemporaryDirectory(prefix="bench_warm_") as tmp, \
            WarmPool(args.nproc, python=sys.executable, base_env=worker_env(0, 0, args.nproc, 0)) as pool:
        workdir = Path(tmp)
        script = workdir / "rank.py"
        script.write_text(textwrap.dedent(RANK_SCRIPT))
        attempt = 0
        for repeat in range(args.repeats):
            pool.refill()
            if not pool.wait_ready(TIMEOUT_S):
                raise SystemExit(f"bench_warm: zygote not ready: {pool.disabled or 'timeout'}")
            for mode in ("cold", "warm"):
                result = run_attempt(pool if mode == "warm" else None, script=script, workdir=workdir,
                                     nproc=args.nproc, attempt=attempt)
                attempt += 1
                results[mode].append(result)
                print(f"repeat {repeat + 1}/{args.repeats} {mode}: first line {result['first_line']:.3f}s, "
                      f"all_reduce {result['all_reduce']:.3f}s", flush=True)
    cold = statistics.median(r["all_reduce"] for r in results["cold"])
    warm = statistics.median(r["all_reduce"] for r in results["warm"])
    print()
    print(f"nproc={args.nproc}, repeats={args.repeats}, python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs")
    print(table(results))
    print(f"\nwarm starts reach the first all_reduce {cold / warm:.1f}x sooner ({cold - warm:.2f}s saved per restart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
