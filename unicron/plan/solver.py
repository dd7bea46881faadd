"""Cost-aware plan: how many healthy nodes each job gets, and which ones.

Objective (docs/planner.md), with x = a job's node count before the failure, x' after:

    reward = sum_j w_j*T_j(x'_j)*horizon_s - sum_{j changed or hit} w_j*T_j(x_j)*transition_s

A job's reward depends only on its own x' (a job keeping its size and not hit keeps its nodes
and pays nothing), so the best split of the healthy nodes is a knapsack solved exactly by
dynamic programming over jobs and node counts: S[i][c] = max_k S[i-1][c-k] + r_i(k).
Placement then keeps unchanged jobs on their nodes, shrinks jobs inside their largest rack,
and grows jobs into the racks they are in, else the rack that fits them whole, each leaving
the jobs still to grow the free nodes of their own racks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from unicron.plan.model import Job, PlanInput


@dataclass(frozen=True)
class JobDecision:
    name: str
    weight: float
    before: tuple[str, ...]
    after: tuple[str, ...]
    hit: bool
    changed: bool
    rate_before: float  # T(x)
    rate_after: float  # T(x')
    reward: float  # this job's term of the objective
    reason: str


@dataclass(frozen=True)
class Plan:
    decisions: tuple[JobDecision, ...]
    objective: float
    waf: float  # sum w*T(x') after the plan
    waf_before: float  # sum w*T(x) before the failure
    idle: tuple[str, ...]  # healthy nodes no job uses

    @property
    def assignment(self) -> dict[str, list[str]]:
        return {d.name: list(d.after) for d in self.decisions}


def job_reward(job: Job, count: int, hit: bool, horizon_s: float, transition_s: float) -> float:
    """r_j(x'): the job's term of the objective if it ends up on ``count`` nodes."""
    before = len(job.nodes)
    gain = job.weight * job.rate(count) * horizon_s
    pays = hit or count != before
    return gain - (job.weight * job.rate(before) * transition_s if pays else 0.0)


def _options(job: Job, capacity: int, hit: bool, horizon_s: float, transition_s: float) -> list[tuple[int, float]]:
    """(count, reward) worth considering: runnable counts that beat every smaller count.

    A count whose reward a smaller count matches is never needed (the knapsack allows idle
    nodes). The current size comes first so that ties keep a job where it is.
    """
    counts = [0] + [k for k in job.throughput if 0 < k <= capacity and job.runnable(k)]
    kept: list[tuple[int, float]] = []
    best = -np.inf
    for k in sorted(counts):
        r = job_reward(job, k, hit, horizon_s, transition_s)
        if r > best:
            kept.append((k, r))
            best = r
    current = len(job.nodes)
    kept.sort(key=lambda kr: (kr[0] != current, kr[0]))
    return kept


def _add_job(best: np.ndarray, options: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """One knapsack step: new[c] = max over options (k, r) of best[c - k] + r, and the k used.

    One in-place pass over the shifted ``best`` per option: a strict ``>`` lets options earlier
    in the list win ties. (Taking every option's column at once and an argmax across them made
    a transposed (options x capacity) copy per job, 5x slower at 10,000 nodes.)
    """
    capacity = len(best) - 1
    new = np.full(capacity + 1, -np.inf)
    choice = np.zeros(capacity + 1, dtype=np.int64)
    for k, r in options:
        candidate = best[:capacity + 1 - k] + r  # best[c - k] + r for c = k .. capacity
        better = candidate > new[k:]
        np.copyto(new[k:], candidate, where=better)
        np.copyto(choice[k:], k, where=better)
    return new, choice


def solve_counts(inp: PlanInput) -> tuple[list[int], float]:
    """Exact best node count per job (in input order) and the objective it reaches."""
    capacity = len(inp.healthy)
    failed = set(inp.failed)
    best = np.zeros(capacity + 1)  # best[c]: best reward of the jobs so far using at most c nodes
    choices: list[np.ndarray] = []
    for job in inp.jobs:
        hit = any(n in failed for n in job.nodes)
        best, choice = _add_job(best, _options(job, capacity, hit, inp.horizon_s, inp.transition_s))
        choices.append(choice)
    counts = [0] * len(inp.jobs)
    room = capacity
    for i in range(len(inp.jobs) - 1, -1, -1):
        counts[i] = int(choices[i][room])
        room -= counts[i]
    return counts, float(best[capacity]) if inp.jobs else 0.0


def _claims(pending: list[tuple[Job, int]], result: dict[str, list[str]], rack_of: dict[str, str],
            free: dict[str, list[str]]) -> Counter[str]:
    """Free nodes that growing jobs still to be placed would take in their own racks, per rack.

    A job's own racks cost it nothing more, so their free nodes are worth most to it. Each job
    claims its need in its own racks, most of its nodes first: an estimate of where it will
    take them, cheap enough to redo for every job placed.
    """
    claim: Counter[str] = Counter()
    for job, need in pending:
        mine = Counter(rack_of[n] for n in result[job.name])
        for rack in sorted(mine, key=lambda r: (-mine[r], r)):
            take = min(need, len(free.get(rack, ())))
            claim[rack] += take
            need -= take
    return claim


def _grow(nodes: list[str], need: int, free: dict[str, list[str]], claim: Counter[str],
          rack_of: dict[str, str]) -> None:
    """Move ``need`` free nodes into ``nodes`` (a growing job's), spanning as few new racks as
    it can while leaving other growing jobs the free nodes of their own racks (``claim``)."""
    mine = Counter(rack_of[n] for n in nodes)
    while need:
        racks = [r for r in free if free[r]]

        def hurts(rack: str, need: int = need) -> bool:  # leaves a job still to come short in its rack
            return len(free[rack]) - min(need, len(free[rack])) < claim[rack]

        # A job that cannot finish in its own racks pays for a new rack anyway: if a new rack
        # fits it whole and hurts no one, it leaves the claimed nodes of its own racks alone.
        leave = (sum(len(free.get(r, ())) for r in mine) < need
                 and any(not mine[r] and len(free[r]) >= need and not hurts(r) for r in racks))

        def preference(rack: str, need: int = need, leave: bool = leave) -> tuple[int, int, int, int, int, str]:
            size = len(free[rack])
            fits = size >= need
            best_fit = size if fits else -size  # the smallest rack that fits, else the largest
            if mine[rack] and not (leave and hurts(rack)):
                # Unclaimed nodes first; then a claimed rack that fits the rest, so that one job
                # still to come loses its rack's nodes rather than two.
                claimed = size <= claim[rack]
                return (0, int(claimed), int(claimed and not fits), -mine[rack], best_fit, rack)
            return (1, 0 if fits else 1, int(hurts(rack)), 0, best_fit, rack)

        rack = min(racks, key=preference)
        count = need
        if preference(rack)[:2] == (0, 0):  # own rack: its unclaimed nodes first
            count = min(need, len(free[rack]) - claim[rack])
        take = free[rack][:count]
        free[rack] = free[rack][len(take):]
        nodes.extend(take)
        mine[rack] += len(take)
        need -= len(take)


def place(inp: PlanInput, counts: list[int]) -> dict[str, tuple[str, ...]]:
    """Pick nodes for the counts: unchanged jobs stay put, the rest prefer one rack."""
    failed = set(inp.failed)
    rack_of = {n.name: n.rack for n in inp.nodes}
    order = {n.name: i for i, n in enumerate(inp.nodes)}
    used: set[str] = set()
    result: dict[str, list[str]] = {}
    growing: list[tuple[Job, int]] = []
    for job, count in zip(inp.jobs, counts, strict=True):
        survivors = [n for n in job.nodes if n not in failed]
        if count <= len(survivors):
            # Shrink inside the racks holding most of the job's nodes; keep the original order.
            per_rack = Counter(rack_of[n] for n in survivors)
            # sorted() is stable: within a rack the job's own order is kept.
            ranked = sorted(survivors, key=lambda n: (-per_rack[rack_of[n]], rack_of[n]))
            keep = set(ranked[:count])
            result[job.name] = [n for n in survivors if n in keep]
        else:
            result[job.name] = survivors
            growing.append((job, count - len(survivors)))
        used.update(result[job.name])
    free: dict[str, list[str]] = {}
    for name in inp.healthy:
        if name not in used:
            free.setdefault(rack_of[name], []).append(name)
    growing.sort(key=lambda jn: (-jn[1], jn[0].name))
    for done, (job, need) in enumerate(growing, start=1):
        _grow(result[job.name], need, free, _claims(growing[done:], result, rack_of, free), rack_of)
        position = {n: i for i, n in enumerate(job.nodes)}  # survivors keep their rank order
        result[job.name].sort(key=lambda n: (n not in position, position.get(n, order[n])))
    return {name: tuple(nodes) for name, nodes in result.items()}


def _reason(job: Job, after: tuple[str, ...], lost: list[str], took: list[str], capacity: int) -> str:
    """Why, in one line; ``took`` names the jobs now running on nodes this job gave up."""
    x, k = len(job.nodes), len(after)
    head = f"lost {', '.join(lost)}; " if lost else ""
    to = f" (to {', '.join(took)})" if took else ""
    if x == 0:  # a job waiting to start (it has no nodes to keep)
        if k:
            return f"started on {k} node(s)"
        if not any(job.runnable(c) for c in range(1, capacity + 1)):
            return "waiting: no runnable size fits on the healthy nodes"
        return "waiting: no runnable size pays off on the nodes left"
    if not lost and set(after) == set(job.nodes):
        return "unchanged: keeps its nodes, pays no transition"
    if k == 0:
        if not any(job.runnable(c) for c in range(1, capacity + 1)):
            return head + "stopped: no runnable size fits on the healthy nodes"
        return head + f"stopped: its nodes earn more weighted throughput elsewhere{to}"
    if k == x:
        return head + f"same size on {k} node(s), failed node(s) replaced"
    if k > x:
        return head + f"grew {x}->{k}: the added throughput over the horizon outweighs the transition"
    if lost and k == x - len(lost):
        return head + f"runs on its {k} surviving node(s)"
    return head + f"shrank {x}->{k}: the nodes earn more weighted throughput elsewhere{to}"


def plan(inp: PlanInput) -> Plan:
    """Solve and place; every number in the result is recomputed from the chosen node sets."""
    counts, _ = solve_counts(inp)
    placed = place(inp, counts)
    failed = set(inp.failed)
    healthy = inp.healthy
    runs_on = {n: name for name, nodes in placed.items() for n in nodes}
    decisions = []
    for job in inp.jobs:
        after = placed[job.name]
        lost = [n for n in job.nodes if n in failed]
        changed = set(after) != set(job.nodes)
        reward = job.weight * job.rate(len(after)) * inp.horizon_s
        if changed or lost:
            reward -= job.weight * job.rate(len(job.nodes)) * inp.transition_s
        decisions.append(JobDecision(
            name=job.name, weight=job.weight, before=job.nodes, after=after, hit=bool(lost), changed=changed,
            rate_before=job.rate(len(job.nodes)), rate_after=job.rate(len(after)), reward=reward,
            reason=_reason(job, after, lost, sorted({runs_on[n] for n in job.nodes if n in runs_on} - {job.name}),
                           len(healthy))))
    used = {n for d in decisions for n in d.after}
    return Plan(decisions=tuple(decisions), objective=float(sum(d.reward for d in decisions)),
                waf=float(sum(d.weight * d.rate_after for d in decisions)),
                waf_before=float(sum(j.weight * j.rate(len(j.nodes)) for j in inp.jobs)),
                idle=tuple(n for n in healthy if n not in used))
