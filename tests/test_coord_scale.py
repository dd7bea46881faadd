"""The coordinator at scale: what every heartbeat asks (the job's activity, silent nodes, the
next deadline) is kept as nodes and steps come, not found by a scan of every node; and the
kept answers are the scans' answers, over random runs (seeded: a failure replays)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from unicron.coord.decide import Decision
from unicron.coord.job import JobCore
from unicron.coord.lastheard import LastHeard
from unicron.coord.membership import Membership, NodeState
from unicron.coord.outbox import OpenStore
from unicron.coord.progress import RankProgress
from unicron.coord.records import JobSpec, Phase
from unicron.detect.activity import Activity
from unicron.detect.hang import uneven_progress

INTERVAL = 0.5


class Restarts:
    def decide(self, faults, stacks, now, **_kw) -> Decision:
        return Decision("restart", 0.0, "restart it", "SEV2", "test")


def join_body(node: str, mn: int, mx: int, nproc: int = 2) -> dict[str, Any]:
    return {"node_id": node, "host": f"h-{node}", "nproc": nproc, "pid": 1, "min_nodes": mn, "max_nodes": mx,
            "max_restarts": 1000, "last_call_s": 0, "heartbeat_timeout_s": 3, "join_timeout_s": 600,
            "stop_timeout_s": 10}


# ---- the scans the kept answers replace (as the coordinator computed them before) ----------
def scan_activity(core: JobCore, now: float) -> Activity:
    active = [n for n in core.members.nodes.values() if n.state is NodeState.ACTIVE]
    level = max((n.activity for n in active), default=Activity.IDLE)
    a = core.attempt if core.phase is Phase.RUNNING else None
    if a is None:
        return level
    silent = any(now - n.last_heartbeat > 2 * INTERVAL for n in active if n.node_id in a.nodes)
    ended = a.silence_ended_at
    recovering = ended is not None and any(a.steps.get(r, (0, ended))[1] <= ended for r in range(a.world_size))
    if silent or recovering:
        level = max(level, Activity.BUSY)
    if uneven_progress(a.steps, now, 2 * INTERVAL):
        level = Activity.WORKING
    return level


def scan_next_tick_s(core: JobCore, now: float) -> float:
    if core.phase in (Phase.DONE, Phase.FAILED):
        return float("inf")
    if core.phase is not Phase.RUNNING:
        return 0.0
    active = [n for n in core.members.nodes.values() if n.state is NodeState.ACTIVE]
    deadlines = [n.last_heartbeat + 3.0 for n in active]
    deadlines += [n.last_heartbeat + 2 * INTERVAL for n in active if n.node_id not in core._told_silent]
    return max(0.0, min(deadlines, default=float("inf")) - now + 0.001)


def test_membership_kept_answers_equal_the_scans_over_random_joins_heartbeats_leaves_and_expiries() -> None:
    rng = random.Random(1606)
    m = Membership(1, 40, last_call_s=0, heartbeat_timeout_s=3.0)
    now = 0.0
    for _ in range(6000):
        op = rng.random()
        now += rng.choice((0.0, 0.01, 0.1, 0.4, 1.5, 4.0)) if rng.random() < 0.9 else -rng.random()  # a clock step back
        ids = list(m.nodes)
        if op < 0.15:
            m.join(f"n{rng.randrange(60)}", "h", 1, None, now)
        elif op < 0.55 and ids:
            node = rng.choice(ids)
            if m.heartbeat(node, now):
                m.set_activity(node, rng.choice(list(Activity)))
        elif op < 0.6 and ids:
            m.leave(rng.choice(ids), rng.choice((NodeState.LEFT, NodeState.LOST, NodeState.EXCLUDED)))
        elif op < 0.7:
            lost = m.expire(now, frozenset(rng.sample(ids, min(len(ids), 2))))
            assert all(n.state is NodeState.LOST for n in lost)
        elif op < 0.72:
            m.shift(rng.random())
        active = [n for n in m.nodes.values() if n.state is NodeState.ACTIVE]
        assert m.count() == len(active)
        assert m.highest_activity() == max((n.activity for n in active), default=Activity.IDLE)
        after = rng.choice((0.5, 1.0, 3.0))
        assert {n.node_id for n in m.silent(now, after)} == {n.node_id for n in active
                                                             if now - n.last_heartbeat > after}
        skip = {n.node_id for n in rng.sample(active, min(len(active), rng.randrange(4)))}
        assert m.oldest_heartbeat(skip) == min((n.last_heartbeat for n in active if n.node_id not in skip),
                                               default=None)


def test_rank_progress_answers_equal_the_scans_with_times_out_of_order() -> None:
    rng = random.Random(77)
    for _ in range(40):
        p, ref = RankProgress(), {}
        world, now, ended = rng.randrange(1, 12), 0.0, None
        for _ in range(300):
            now += rng.choice((0.0, 0.1, 0.3, 1.2)) if rng.random() < 0.9 else -rng.random()
            rank, step = rng.randrange(-1, world + 2), rng.randrange(-2, 30)
            p.note(rank, step, now)
            if step > ref.get(rank, (-1, 0.0))[0]:  # the rule the attempt always kept steps by
                ref[rank] = (step, now)
            if rng.random() < 0.05:
                ended = now
                p.heard_again(now, world)
            assert p.steps == ref
            assert p.slowest() == min((s for s, _ in ref.values()), default=None)
            ask = now - rng.choice((0.0, 0.0, 0.5, 2.0))  # also asked about a moment ago
            within = rng.choice((0.5, 1.0))
            assert p.uneven(ask, within) == uneven_progress(ref, ask, within), (ref, ask)
            assert p.recovering() == (ended is not None and any(
                ref.get(r, (0, ended))[1] <= ended for r in range(world)))


@pytest.mark.parametrize("seed", [3, 14, 159])
def test_the_jobs_activity_equals_the_scan_over_a_random_run(seed: int) -> None:
    """Joins, heartbeats (activities, steps, old attempts), leaves, expiries, stops and
    restarts in random order: at every moment the kept activity is what a scan finds."""
    rng = random.Random(seed)
    core = JobCore(JobSpec("job", 2, 10, max_restarts=1000, last_call_s=0, heartbeat_timeout_s=3.0,
                           heartbeat_interval_s=INTERVAL, stop_timeout_s=10), Restarts(), now=0.0)
    now, steps = 0.0, {}
    checked = 0
    for _ in range(3000):
        now += rng.choice((0.0, 0.02, 0.05, 0.05, 0.1)) if rng.random() < 0.97 else rng.choice((1.1, 3.5))
        ids = [n.node_id for n in core.members.active_any_order()]
        op, outs = rng.random(), []
        if op < 0.08:
            node = f"n{rng.randrange(14)}"
            outs = core.on_join(node, join_body(node, 2, 10), now)
        elif op < 0.7 and ids:
            node = rng.choice(ids)
            attempt = core.attempt.number if core.attempt else -1
            rank0 = core.attempt.nodes.index(node) * 2 if core.attempt and node in core.attempt.nodes else 100
            workers = []
            for rank in (rank0, rank0 + 1):
                steps[rank] = steps.get(rank, 0) + rng.choice((0, 0, 1, 1, 3))
                workers.append({"rank": rank, "step": steps[rank]})
            outs = core.on_heartbeat(node, {"attempt": attempt if rng.random() < 0.9 else attempt - 1,
                                            "workers": workers, "health": {}, "done": False,
                                            "activity": rng.choice(("idle", "idle", "busy", "working"))}, now)
        elif op < 0.73 and ids:
            outs = core.on_leave(rng.choice(ids), {"reason": "bye"}, now)
        elif op < 0.8 and core.phase is Phase.STOPPING and core.attempt and ids:
            outs = core.on_stopped(rng.choice(ids), {"attempt": core.attempt.number, "snapshots": {}}, now)
        else:
            outs = core.tick(now)
        if any(isinstance(o, OpenStore) for o in outs):  # the store opens at once
            core.start_attempt("", 1, now)
            steps = {}
        if core.phase in (Phase.DONE, Phase.FAILED):
            break
        for ask in (now, now + rng.choice((0.1, 0.8, 2.5))):
            assert core.job_activity(ask) is scan_activity(core, ask), (seed, ask)
            assert core.next_tick_s(ask) == scan_next_tick_s(core, ask)
        checked += core.phase is Phase.RUNNING
    assert checked > 300  # the run spent a good part of its time running


class NoScan(dict):
    """A dict that must not be walked: the job's nodes, while only heartbeats come."""

    def _walked(self, *_a: Any) -> Any:
        raise AssertionError("the coordinator scanned every node")

    __iter__ = values = items = keys = _walked  # type: ignore[assignment]


class NoScanList(list):
    def _walked(self, *_a: Any) -> Any:
        raise AssertionError("the coordinator scanned every node of the attempt")

    __iter__ = __contains__ = index = _walked  # type: ignore[assignment]


def test_a_heartbeat_and_the_tick_after_it_look_at_no_other_node() -> None:
    """Acceptance (F6): 2,000 nodes cost 16 ms per heartbeat, most of it in finding the job's
    activity from every node, twice; at 0.5 s heartbeats that is more CPU than one core has."""
    n = 1000
    core = JobCore(JobSpec("big", n, n, max_restarts=1000, heartbeat_timeout_s=3.0, heartbeat_interval_s=INTERVAL),
                   Restarts(), now=0.0)
    for i in range(n):
        core.on_join(f"n{i}", join_body(f"n{i}", n, n, nproc=8), 0.0)
    assert any(isinstance(o, OpenStore) for o in core.tick(0.0))
    core.start_attempt("", 1, 0.0)
    attempt = core.attempt
    assert attempt is not None
    first = {node: 8 * r for r, node in enumerate(attempt.nodes)}
    core.members.nodes = NoScan(core.members.nodes)
    attempt.nodes = NoScanList(attempt.nodes)
    for k in range(3 * n):
        node, now = f"n{k % n}", 0.1 + k * INTERVAL / n
        workers = [{"rank": first[node] + r, "step": 1 + k // n} for r in range(8)]
        outs = core.on_heartbeat(node, {"attempt": 0, "workers": workers, "health": {}, "activity": "idle",
                                        "done": False}, now)
        assert len(outs) == 1 and outs[0].body["activity"] == "idle"
        assert core.tick(now) == []
        assert 0 < core.next_tick_s(now) <= 2 * INTERVAL
    assert core.phase is Phase.RUNNING and core.members.count() == n


def test_the_oldest_of_few_keys_and_removal_from_the_middle_keep_the_heap_in_order() -> None:
    heard = LastHeard()
    for key, at in (("a", 5.0), ("b", 1.0), ("c", 3.0), ("d", 2.0), ("e", 4.0)):
        heard.set(key, at)
    heard.discard("d")
    heard.discard("zz")  # not there: nothing happens
    assert heard.oldest() == 1.0 and heard.oldest(skip={"b"}) == 3.0 and "d" not in heard and len(heard) == 4
    heard.set("b", 6.0)
    assert heard.oldest() == 3.0 and sorted(heard.silent(6.0, 1.5)) == ["c", "e"]
    heard.set("a", 0.5)  # a clock stepped back
    assert heard.oldest() == 0.5 and heard.get("a") == 0.5 and heard.get("d") is None
