"""Simulator: invariants (nothing beats the no-failure bound), hand-checked cases, traces."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron.errors import InputError
from unicron.plan.model import PlanInput
from unicron.plan.simulate import POLICIES, SimParams, simulate, upper_bound_waf
from unicron.plan.trace import LLAMA3_NODE_MTBF_S, Trace, llama3_trace, poisson_trace

PARAMS = SimParams(detect_s=600, restart_s=1380, setup_s=840, checkpoint_interval_s=3600,
                   redundancy_overhead=0.25, redundancy_recovery_s=60)


def cluster(n_nodes: int, jobs: list[dict[str, Any]], transition_s: float = 120) -> PlanInput:
    return PlanInput.from_dict({
        "nodes": [{"name": f"n{i}", "gpus": 8, "rack": f"r{i // 4}"} for i in range(n_nodes)],
        "jobs": jobs, "horizon_s": 3600, "transition_s": transition_s})


def trace(duration: float, events: list[tuple[float, str, str]]) -> Trace:
    return Trace.from_dict({"duration_s": duration,
                            "events": [{"t": t, "node": n, "kind": k} for t, n, k in events]})


ONE_JOB = [{"name": "a", "weight": 2.0, "nodes": ["n0", "n1"], "throughput": {"1": 1.0, "2": 2.0}}]


def test_no_failures_every_policy_runs_as_placed() -> None:
    inp = cluster(3, ONE_JOB)
    result = simulate(inp, trace(10_000, []), PARAMS)
    assert result.no_failure == pytest.approx(2.0 * 2.0 * 10_000)
    for name in ("unicron", "restart", "shrink"):
        assert result.work(name) == pytest.approx(result.no_failure)
    assert result.work("redundancy") == pytest.approx(0.75 * result.no_failure)
    assert result.bound == pytest.approx(2.0 * 2.0 * 10_000)  # table stops at 2 nodes


def test_one_failure_hand_computed() -> None:
    # n1 dies at t=5,400 (1,800 s after the first checkpoint) and returns at t=9,000; spare n2.
    inp = cluster(3, ONE_JOB, transition_s=120)
    events = trace(20_000, [(5400, "n1", "down"), (9000, "n1", "up")])
    r = simulate(inp, events, PARAMS)
    rate = 2.0 * 2.0
    # unicron: replaces n1 by the spare at once, 120 s transition, nothing else lost.
    assert r.work("unicron") == pytest.approx(rate * (20_000 - 120))
    # restart: loses 1,800 s since the checkpoint, hangs 600 s, restarts on the spare after 1,380 s.
    assert r.work("restart") == pytest.approx(rate * (20_000 - 1800 - 600 - 1380))
    # shrink: 1 node after 600 + 840 s (rollback 1,800 s); n1 back at 9,000: regrow, rollback again.
    ran_small = 9000 - (5400 + 600 + 840)
    lost_on_regrow = 1.0 * 2.0 * (ran_small % 3600)
    expected = rate * (5400 - 1800) + 2.0 * ran_small - lost_on_regrow + rate * (20_000 - 9000 - 840)
    assert r.work("shrink") == pytest.approx(expected)
    # redundancy: 75% always; half the job for 60 s of recovery... then on 1 node at half until n1 returns.
    slow = 0.75 * rate
    expected = slow * 5400 + slow / 2 * (9000 - 5460) + slow * (20_000 - 9060)
    assert r.work("redundancy") == pytest.approx(expected)


def test_unicron_moves_nodes_to_the_heavier_job() -> None:
    jobs = [{"name": "light", "weight": 1.0, "nodes": ["n0", "n1"], "throughput": {"1": 1.0, "2": 2.0}},
            {"name": "heavy", "weight": 10.0, "nodes": ["n2", "n3"], "throughput": {"2": 2.0}}]
    inp = cluster(4, jobs)
    r = simulate(inp, trace(100_000, [(1000, "n3", "down")]), PARAMS)
    # heavy cannot run on 1 node; unicron gives it one of light's nodes, the baselines cannot.
    assert r.work("unicron") > 1.5 * max(r.work("shrink"), r.work("restart"))


@st.composite
def random_runs(draw: Any) -> tuple[PlanInput, Trace]:
    n_nodes = draw(st.integers(2, 8))
    free = list(range(n_nodes))
    jobs = []
    for j in range(draw(st.integers(1, 3))):
        take = draw(st.integers(1, max(1, len(free)))) if free else 0
        mine, free = free[:take], free[take:]
        counts = set(draw(st.lists(st.integers(1, n_nodes), max_size=4))) | ({len(mine)} if mine else {1})
        table = {str(c): draw(st.floats(0.1, 10)) for c in counts}
        jobs.append({"name": f"j{j}", "weight": draw(st.floats(0.1, 5)), "nodes": [f"n{i}" for i in mine],
                     "min_nodes": 1, "throughput": table})
    inp = cluster(n_nodes, jobs, transition_s=draw(st.floats(0, 2000)))
    duration = draw(st.floats(1000, 200_000))
    tr = poisson_trace([f"n{i}" for i in range(n_nodes)], duration, draw(st.floats(2000, 100_000)),
                       hardware_fraction=0.5, hardware_repair_s=draw(st.floats(100, 50_000)),
                       transient_repair_s=300, seed=draw(st.integers(0, 10**6)))
    return inp, tr


@settings(max_examples=60, deadline=None)
@given(random_runs())
def test_no_policy_beats_the_no_failure_bound(run: tuple[PlanInput, Trace]) -> None:
    inp, tr = run
    result = simulate(inp, tr, PARAMS)
    assert result.bound >= result.no_failure - 1e-6 * result.bound
    for policy in result.policies:
        assert -1e-6 <= policy.work <= result.bound * (1 + 1e-9) + 1e-6, policy.name
        times = [t for t, _ in policy.timeline]
        assert times == sorted(times) and times[-1] == tr.duration_s


def test_upper_bound_is_best_split_of_all_nodes() -> None:
    jobs = [{"name": "a", "weight": 1.0, "nodes": ["n0"], "throughput": {"1": 1.0, "3": 4.0}},
            {"name": "b", "weight": 1.0, "nodes": ["n1"], "throughput": {"1": 1.5}}]
    assert upper_bound_waf(cluster(4, jobs)) == pytest.approx(5.5)  # a on 3, b on 1


def test_trace_errors_name_the_event() -> None:
    with pytest.raises(InputError, match=r"trace.events\[1\]: node 'n0' is already down"):
        Trace.from_dict({"duration_s": 10, "events": [{"t": 1, "node": "n0", "kind": "down"},
                                                      {"t": 2, "node": "n0", "kind": "down"}]})
    with pytest.raises(InputError, match=r"trace.events\[0\].node: unknown node 'x'"):
        Trace.from_dict({"duration_s": 10, "events": [{"t": 1, "node": "x", "kind": "down"}]}, {"n0"})
    with pytest.raises(InputError, match=r"trace.events\[1\].t: events must be in time order"):
        Trace.from_dict({"duration_s": 10, "events": [{"t": 5, "node": "a", "kind": "down"},
                                                      {"t": 2, "node": "b", "kind": "down"}]})
    with pytest.raises(InputError, match=r"trace.duration_s"):
        Trace.from_dict({"duration_s": -1, "events": []})


def test_generated_traces_are_valid_and_reproducible() -> None:
    nodes = [f"n{i}" for i in range(64)]
    a = llama3_trace(nodes, 30 * 86400, seed=3)
    assert a == llama3_trace(nodes, 30 * 86400, seed=3)
    assert Trace.from_dict(a.to_dict(), set(nodes)) == a  # valid: alternating down/up per node
    downs = sum(e.kind == "down" for e in a.events)
    expected = 64 * 30 * 86400 / LLAMA3_NODE_MTBF_S  # about 7 failures
    assert 0 < downs < 4 * expected + 5
    assert "419" in a.source
    assert set(POLICIES) == {"unicron", "restart", "shrink", "redundancy"}


EXAMPLES = __import__("pathlib").Path(__file__).resolve().parent.parent / "examples" / "plan"


@pytest.mark.parametrize("cluster_file, trace_file", [
    ("sim-128gpu.json", "trace-synthetic.json"),
    ("sim-128gpu.json", "trace-llama3-128gpu.json"),
    ("sim-llama3-scale.json", "trace-llama3-scale.json"),
])
def test_shipped_traces_fit_their_clusters(cluster_file: str, trace_file: str) -> None:
    from unicron.plan.commands import load_document, load_plan_input

    inp = load_plan_input(EXAMPLES / cluster_file)
    tr = Trace.from_dict(load_document(EXAMPLES / trace_file), {n.name for n in inp.nodes})
    assert tr.events and tr.source


def test_trace_generator_command(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from unicron.plan.trace import main

    assert main(["synthetic", "--input", str(EXAMPLES / "small.json"), "--days", "2", "--seed", "5",
                 "--mtbf-days", "0.5", "--repair-hours", "1"]) == 0
    data = json.loads(capsys.readouterr().out)
    tr = Trace.from_dict(data, {f"n{i}" for i in range(8)})
    assert sum(e.kind == "down" for e in tr.events) >= 4  # 8 nodes x 2 days / 0.5 days ~ 32
    assert "seed 5" in tr.source
