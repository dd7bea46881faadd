"""Planner benchmark: plan time from 16 to 4,096 nodes and 1 to 256 jobs.

    .venv/bin/python scripts/bench_plan.py [--repeat 3] [--tables sparse|model|dense]
    .venv/bin/python scripts/bench_plan.py --transfers [--repeat 3]

Each instance: nodes in racks of 32, jobs of equal share (a random quarter smaller, so spare
nodes exist), 3 failed nodes. Throughput tables: ``sparse`` ~20 runnable counts (powers of
two, the current size, 8 random counts); ``model`` the counts a GPT-3 model of a random size
(125M..175B, A100) has a valid layout for; ``dense`` every count 1..nodes runnable (the worst
case for the knapsack). Prints a markdown table of the median plan() time in milliseconds, then how
it grows (the exponent k in time ~ size^k between neighbouring sizes).

``--transfers`` times the state transfer plan instead (``transfer_plan``, what `unicron plan`
runs after ``plan()``) at 256 to 4,096 nodes on its worst case: one job on all nodes but two,
8 GPUs per node, 16-way model parallel (two nodes per replica), losing its second node, so every
later rank's shard moves and each fetch chooses among every rack's holders.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from unicron.plan.model import PlanInput
from unicron.plan.solver import plan
from unicron.plan.throughput import GPT3_SHAPES, ModelSpec, throughput_table
from unicron.plan.transfers import transfer_plan

NODES = (16, 64, 256, 1024, 2048, 4096)
JOBS = (1, 4, 16, 64, 256)


_MODEL_TABLES: dict[tuple[float, int], dict[int, float]] = {}


def model_table(params_b: float, n_nodes: int) -> dict[int, float]:
    if (params_b, n_nodes) not in _MODEL_TABLES:
        _MODEL_TABLES[params_b, n_nodes] = throughput_table(ModelSpec.gpt3_like(params_b, "A100"), n_nodes, 8)
    return _MODEL_TABLES[params_b, n_nodes]


def instance(n_nodes: int, n_jobs: int, tables: str, seed: int = 0) -> PlanInput:
    rng = random.Random(seed)
    per = n_nodes // n_jobs
    jobs = []
    for k in range(n_jobs):
        size = max(1, per - rng.randint(0, per // 4))
        if tables == "model":
            fitting = [p for p in GPT3_SHAPES if any(c <= size for c in model_table(p, n_nodes))]
            table = model_table(rng.choice(fitting) if fitting else 0.125, n_nodes)
            size = max((c for c in table if c <= size), default=0)
            throughput = {str(c): t for c, t in table.items()}
        else:
            if tables == "dense":
                counts = set(range(1, n_nodes + 1))
            else:
                counts = {c for c in (2**i for i in range(13)) if c <= n_nodes} | {size}
                counts |= {rng.randint(1, n_nodes) for _ in range(8)}
            throughput = {str(c): c**0.9 * rng.uniform(0.9, 1.1) for c in sorted(counts)}
        jobs.append({"name": f"j{k}", "weight": rng.uniform(0.5, 2.0),
                     "nodes": [f"n{i}" for i in range(k * per, k * per + size)], "throughput": throughput})
    nodes = [{"name": f"n{i}", "gpus": 8, "rack": f"r{i // 32}"} for i in range(n_nodes)]
    failed = sorted({f"n{rng.randrange(n_nodes)}" for _ in range(3)})
    return PlanInput.from_dict({"nodes": nodes, "jobs": jobs, "failed": failed, "horizon_s": 3600,
                                "transition_s": 300})


def time_plan(inp: PlanInput, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        plan(inp)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def big_job(n_nodes: int) -> PlanInput:
    job = {"name": "big", "nodes": [f"n{i}" for i in range(n_nodes - 2)], "state_gb": 100, "model_parallel": 16,
           "throughput": {str(c): float(c) for c in range(1, n_nodes + 1)}}
    return PlanInput.from_dict({"nodes": [{"name": f"n{i}", "gpus": 8, "rack": f"r{i // 32}"} for i in range(n_nodes)],
                                "jobs": [job], "failed": ["n1"]})


def bench_transfers(repeat: int) -> None:
    print(f"transfer_plan() median of {repeat}, seconds (one job on all nodes but two, 16-way model parallel)\n")
    print("| nodes | ranks moved | plan() s | transfer_plan() s |")
    print("|---|---|---|---|")
    for n in NODES[2:]:
        inp = big_job(n)
        result = plan(inp)
        samples = []
        for _ in range(repeat):
            start = time.perf_counter()
            transfers = transfer_plan(inp, result)
            samples.append(time.perf_counter() - start)
        moved = sum(t.kind != "in-place" for t in transfers)
        print(f"| {n} | {moved} | {time_plan(inp, repeat):.3f} | {statistics.median(samples):.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tables", choices=["sparse", "model", "dense"], default="sparse",
                        help="throughput tables (see above)")
    parser.add_argument("--transfers", action="store_true", help="time transfer_plan() instead (see above)")
    args = parser.parse_args()
    if args.transfers:
        bench_transfers(args.repeat)
        return
    results: dict[tuple[int, int], float] = {}
    print(f"plan() median of {args.repeat}, milliseconds ({args.tables} tables)\n")
    print("| nodes \\ jobs | " + " | ".join(str(j) for j in JOBS) + " |")
    print("|---" * (len(JOBS) + 1) + "|")
    for n in NODES:
        cells = []
        for j in JOBS:
            if j > n:
                cells.append("-")
                continue
            results[n, j] = time_plan(instance(n, j, args.tables), args.repeat)
            cells.append(f"{results[n, j] * 1e3:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    print("\ngrowth exponent k (time ~ size^k) between neighbouring sizes:")
    for j in JOBS:
        steps = [f"{a}->{b}: {math.log(results[b, j] / results[a, j]) / math.log(b / a):.2f}"
                 for a, b in zip(NODES, NODES[1:], strict=False) if (a, j) in results and (b, j) in results]
        if steps:
            print(f"  {j} jobs, nodes " + ", ".join(steps))
    for n in NODES:
        steps = [f"{a}->{b}: {math.log(results[n, b] / results[n, a]) / math.log(b / a):.2f}"
                 for a, b in zip(JOBS, JOBS[1:], strict=False) if (n, a) in results and (n, b) in results]
        if steps:
            print(f"  {n} nodes, jobs " + ", ".join(steps))


if __name__ == "__main__":
    main()
