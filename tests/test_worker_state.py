"""A 2-rank gloo run killed mid-training resumes from State snapshots, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from helpers_worker import (
    PYTHON,
    Rendezvous,
    agent_socket,
    base_env,
    finish,
    wait_until,
    workers,
    write_script,
)

from unicron.worker import snapshot

TRAIN = """
    import os, random, sys
    from datetime import timedelta
    import numpy as np
    import torch
    import torch.distributed as dist
    import unicron

    total, out = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    torch.manual_seed(100 + rank)  # per-rank data and dropout
    random.seed(rank)
    np.random.seed(rank)
    state = unicron.State(model=model, optimizer=opt, scheduler=sched, extra={"samples": 0, "scales": []})
    start = state.restore()
    print("START", start, flush=True)
    for step in range(start, total):
        x = torch.randn(16, 8)
        scale = random.uniform(0.5, 1.5)
        y = x.sum(1, keepdim=True) * scale + float(np.random.rand())
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        sched.step()
        state.extra["samples"] += 16
        state.extra["scales"].append(scale)
        state.commit(step + 1)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "extra": state.extra,
                "next_draw": torch.rand(4)}, f"{out}.rank{rank}.pt")
    dist.destroy_process_group()
    os._exit(0)  # gloo may abort in teardown after a clean finish
"""

TOTAL = 40


def _run_to_end(script: Path, out: Path, env_for_rank, attempt: int = 0) -> list[str]:
    rdzv = Rendezvous(2)
    with workers() as group:
        procs = [group.start([*env_for_rank(r)[0], str(script), str(TOTAL), str(out)],
                             base_env(**rdzv.rank_env(r, attempt), **env_for_rank(r)[1])) for r in (0, 1)]
        results = [finish(p, 100) for p in procs]
    for rc, _, err in results:
        assert rc == 0, err
    return [out_ for _, out_, _ in results]


def _assert_same(a: object, b: object, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_killed_run_resumes_bit_for_bit(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TRAIN)
    snaps = tmp_path / "snaps"

    # Reference: uninterrupted, plain python (no unicron at all: State is a no-op).
    _run_to_end(script, tmp_path / "ref", lambda r: ([PYTHON, "-u"], {}))

    # Interrupted: rank 1 slowed so the kill lands mid-run, then both ranks SIGKILLed.
    rdzv = Rendezvous(2)
    with agent_socket() as agent, workers() as group:
        procs = [
            group.boot(script, str(TOTAL), str(tmp_path / "broken"),
                       env=base_env(**rdzv.rank_env(r), UNICRON_AGENT_ADDR=agent.addr,
                                    UNICRON_SNAPSHOT_DIR=str(snaps), UNICRON_INJECT="slow=0.05@1:1"))
            for r in (0, 1)
        ]
        seen = agent.wait_for(lambda m: m["t"] == "step" and m["rank"] == 1 and m["step"] >= 12, 90)["step"]
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[1].wait(10)
        os.kill(procs[0].pid, signal.SIGKILL)  # as the agent does with ranks stuck in a collective
        procs[0].wait(10)
        agent.drain(0.2)
        snapped = {r: {m["snap"] for m in agent.of("step", r) if m.get("snap")} for r in (0, 1)}
    assert not (tmp_path / "broken.rank0.pt").exists()  # it really was interrupted

    found = snapshot.steps_by_rank(snaps)
    restore = snapshot.common_step(found, [0, 1])
    assert restore is not None and seen - 2 <= restore < TOTAL, (seen, found)
    assert all(len(steps) <= snapshot.KEEP for steps in found.values())
    # The agent was told of a snapshot the rank still holds (a step message names the newest).
    assert all(snapped[r] and max(snapped[r]) >= min(found[r]) for r in (0, 1)), (snapped, found)
    print(f"\nkilled after step {seen}; snapshots {found}; restoring step {restore}")

    outs = _run_to_end(script, tmp_path / "resumed", lambda r: (
        [PYTHON, "-u", "-m", "unicron.worker.boot"],
        {"UNICRON_SNAPSHOT_DIR": str(snaps), "UNICRON_RESTORE_STEP": str(restore)}), attempt=1)
    assert all(f"START {restore}" in out for out in outs)
    for rank in (0, 1):
        ref = torch.load(tmp_path / f"ref.rank{rank}.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"resumed.rank{rank}.pt", weights_only=True)
        assert len(resumed["extra"]["scales"]) == TOTAL
        _assert_same(ref, resumed, f"rank{rank}")
    wait_until(lambda: snapshot.list_steps(snaps / "rank0")[-1:] == [TOTAL], 5, "final snapshot")
    assert not list(snaps.glob("rank*/*.tmp"))
