"""Replay a failure trace through recovery policies and add up the weighted work each one does.

Work is the integral of sum_j w_j * T_j(x_j(t)) * factor_j over time, minus the work a policy
throws away when it rolls a job back to its last checkpoint. Every policy sees the same
cluster, jobs (placed as in the input; ``failed`` is ignored, the run starts healthy) and trace.

- unicron: in-band detection, re-plans the whole cluster with the cost-aware solver on every
  event; a job that changes or is hit stops for ``transition_s`` and loses nothing else
  (state comes from in-memory copies).
- restart: torchrun / Megatron with fixed size. A hit job hangs until the collective timeout
  (``detect_s``), is resubmitted and set up (``restart_s``) once as many healthy unused nodes
  as it had are available (its own first, then spares), and rolls back to its last checkpoint.
- shrink: elastic torchrun, no planning. A hit job restarts at once on its survivors (largest
  runnable size) after ``detect_s + setup_s`` and rolls back; when one of its own nodes
  returns it grows back the same way. It never takes spares or other jobs' nodes.
- redundancy: Bamboo-like. Normal throughput is cut by ``redundancy_overhead``; a hit job
  carries on on all its survivors after ``redundancy_recovery_s`` without rollback (redundant
  copies of the lost nodes' layers stand in, so any count of at least ``min_nodes`` runs, at
  T(x) scaled by survivors/x), and is whole again when its nodes return. Below ``min_nodes``
  it falls back to a checkpoint rollback and waits for its nodes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from unicron.plan.model import Job, PlanInput
from unicron.plan.solver import plan, solve_counts
from unicron.plan.trace import Trace, TraceEvent


@dataclass(frozen=True)
class SimParams:
    detect_s: float = 600.0  # NCCL's default collective timeout: how long baselines hang
    restart_s: float = 23 * 60.0  # resubmit (9 min) + set-up (14 min), the paper's GPT-3 incident
    setup_s: float = 14 * 60.0  # an elastic restart skips the resubmit
    checkpoint_interval_s: float = 3600.0  # assumption; rollbacks lose the time since the last one
    redundancy_overhead: float = 0.25  # assumption: throughput Bamboo-like redundancy costs
    redundancy_recovery_s: float = 60.0  # assumption: re-route to the redundant copy


@dataclass
class JobRun:
    job: Job
    nodes: tuple[str, ...]
    ready_at: float = 0.0  # the job makes progress from here on
    factor: float = 1.0
    waiting_since: float | None = None  # restart policy: hit at, waiting for nodes
    degraded: bool = False  # redundancy policy: survivors carry the lost nodes' work

    def rate(self) -> float:
        if self.degraded:
            full = len(self.job.nodes)
            return self.job.weight * self.job.rate(full) * len(self.nodes) / full * self.factor
        return self.job.weight * self.job.rate(len(self.nodes)) * self.factor

    def rollback(self, t: float, interval_s: float) -> float:
        """Work lost going back to the last checkpoint (one every interval_s of running)."""
        if not self.nodes or t <= self.ready_at:
            return 0.0
        ran = t - self.ready_at
        return self.rate() * (ran - math.floor(ran / interval_s) * interval_s)


class Policy:
    name = "policy"

    def __init__(self, inp: PlanInput, params: SimParams) -> None:
        self.inp = inp
        self.params = params
        self.runs = [JobRun(job, job.nodes, factor=self.normal_factor()) for job in inp.jobs]

    def normal_factor(self) -> float:
        """Fraction of T a job achieves under this policy when nothing fails."""
        return 1.0

    def accrue(self, t0: float, t1: float) -> float:
        return sum(run.rate() * max(0.0, t1 - max(t0, run.ready_at)) for run in self.runs)

    def used(self) -> set[str]:
        return {n for run in self.runs for n in run.nodes}

    def on_event(self, event: TraceEvent, down: set[str]) -> float:
        """Apply one event (``down`` already updated); return the work thrown away."""
        raise NotImplementedError


class UnicronPolicy(Policy):
    name = "unicron"

    def on_event(self, event: TraceEvent, down: set[str]) -> float:
        current = dataclasses.replace(
            self.inp, jobs=tuple(dataclasses.replace(r.job, nodes=r.nodes) for r in self.runs),
            failed=tuple(n.name for n in self.inp.nodes if n.name in down))
        for run, decision in zip(self.runs, plan(current).decisions, strict=True):
            if decision.changed or decision.hit:
                run.nodes = decision.after
                run.ready_at = event.t + self.inp.transition_s
        return 0.0


class RestartPolicy(Policy):
    name = "restart"

    def on_event(self, event: TraceEvent, down: set[str]) -> float:
        lost = 0.0
        if event.kind == "down":
            for run in self.runs:
                if event.node in run.nodes:
                    lost += run.rollback(event.t, self.params.checkpoint_interval_s)
                    run.nodes, run.waiting_since = (), event.t
        used = self.used()
        free = [n.name for n in self.inp.nodes if n.name not in down and n.name not in used]
        for run in self.runs:
            need = len(run.job.nodes)
            if run.waiting_since is None or need > len(free):
                continue
            own = set(run.job.nodes)
            picked = sorted(free, key=lambda n: n not in own)[:need]  # stable: own nodes first, then in order
            taken = set(picked)
            free = [n for n in free if n not in taken]
            run.nodes = tuple(picked)
            run.ready_at = max(event.t, run.waiting_since + self.params.detect_s) + self.params.restart_s
            run.waiting_since = None
        return lost


class ShrinkPolicy(Policy):
    """Elastic resize on the job's own nodes, no planning across jobs."""

    name = "shrink"

    def on_event(self, event: TraceEvent, down: set[str]) -> float:
        lost = 0.0
        used = self.used()
        for run in self.runs:
            hit = event.kind == "down" and event.node in run.nodes
            returns = event.kind == "up" and event.node in run.job.nodes and event.node not in used
            if not (hit or returns):
                continue
            available = [n for n in run.job.nodes if n not in down and (n in run.nodes or n not in used)]
            size = max((k for k in range(len(available) + 1) if run.job.runnable(k)), default=0)
            if not hit and size <= len(run.nodes):
                continue
            lost += run.rollback(event.t, self.params.checkpoint_interval_s)
            run.nodes = tuple(available[:size])
            run.ready_at = event.t + (self.params.detect_s if hit else 0.0) + self.params.setup_s
        return lost


class RedundancyPolicy(Policy):
    name = "redundancy"

    def normal_factor(self) -> float:
        return 1.0 - self.params.redundancy_overhead

    def on_event(self, event: TraceEvent, down: set[str]) -> float:
        lost = 0.0
        for run in self.runs:
            own = run.job.nodes
            if event.node not in own or (event.kind == "down" and event.node not in run.nodes):
                continue
            alive = tuple(n for n in own if n not in down)
            if len(alive) < run.job.min_nodes:
                lost += run.rollback(event.t, self.params.checkpoint_interval_s)
                alive = ()
            run.nodes, run.degraded = alive, 0 < len(alive) < len(own)
            run.ready_at = max(run.ready_at, event.t + self.params.redundancy_recovery_s)
        return lost


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (UnicronPolicy, RestartPolicy, ShrinkPolicy, RedundancyPolicy)}


@dataclass(frozen=True)
class PolicyResult:
    name: str
    work: float  # accumulated weighted work (weight x throughput unit x seconds)
    timeline: tuple[tuple[float, float], ...]  # (t, work so far) at every event (twice on a rollback)


@dataclass(frozen=True)
class SimResult:
    duration_s: float
    events: int
    bound: float  # best possible: the optimal WAF of the whole healthy cluster, all the time
    no_failure: float  # the jobs as placed, never failing
    policies: tuple[PolicyResult, ...]

    def work(self, name: str) -> float:
        return next(p.work for p in self.policies if p.name == name)


def run_policy(policy: Policy, trace: Trace) -> PolicyResult:
    down: set[str] = set()
    work, now = 0.0, 0.0
    timeline = [(0.0, 0.0)]
    for event in trace.events:
        work += policy.accrue(now, event.t)
        now = event.t
        (down.add if event.kind == "down" else down.discard)(event.node)
        timeline.append((now, work))
        lost = policy.on_event(event, down)
        if lost:
            work -= lost
            timeline.append((now, work))
    work += policy.accrue(now, trace.duration_s)
    timeline.append((trace.duration_s, work))
    return PolicyResult(policy.name, work, tuple(timeline))


def upper_bound_waf(inp: PlanInput) -> float:
    """max sum w*T over every split of all nodes: no schedule can do better at any instant."""
    fresh = dataclasses.replace(inp, jobs=tuple(dataclasses.replace(j, nodes=()) for j in inp.jobs),
                                failed=(), horizon_s=1.0, transition_s=0.0)
    return solve_counts(fresh)[1]


def simulate(inp: PlanInput, trace: Trace, params: SimParams = SimParams(),
             policies: tuple[str, ...] = tuple(POLICIES)) -> SimResult:
    start = dataclasses.replace(inp, failed=())
    results = tuple(run_policy(POLICIES[name](start, params), trace) for name in policies)
    initial = sum(j.weight * j.rate(len(j.nodes)) for j in inp.jobs)
    return SimResult(duration_s=trace.duration_s, events=len(trace.events),
                     bound=upper_bound_waf(start) * trace.duration_s, no_failure=initial * trace.duration_s,
                     policies=results)
