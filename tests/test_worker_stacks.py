"""Stack dumps (on STACK_SIGNAL) work while a rank is blocked inside a real gloo collective."""

from __future__ import annotations

import os
import time
from pathlib import Path

from helpers_worker import Rendezvous, agent_socket, base_env, workers, write_script

from unicron.worker.env import STACK_SIGNAL

TRAIN = """
    from datetime import timedelta
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=90))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.ones(1, 2)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
"""


def _dump_until(pid: int, path: Path, needles: tuple[str, ...], timeout_s: float) -> str:
    """Signal until a dump shows every one of ``needles`` (the rank may not be inside the call
    yet, and a dump read while faulthandler writes it has its innermost frames only)."""
    deadline = time.monotonic() + timeout_s
    while True:
        os.kill(pid, STACK_SIGNAL)
        poll_until = time.monotonic() + 0.5
        while time.monotonic() < poll_until:
            text = path.read_text() if path.exists() else ""
            if all(needle in text for needle in needles):
                return text
            time.sleep(0.02)
        if time.monotonic() > deadline:
            raise AssertionError(f"not all of {needles!r} in {path} after {timeout_s}s:\n{text[-3000:]}")


def test_dump_while_blocked_in_gloo_all_reduce(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TRAIN)
    stacks = tmp_path / "stacks"
    rdzv = Rendezvous(2)
    with agent_socket() as agent, workers() as group:
        procs = [
            group.boot(script, env=base_env(**rdzv.rank_env(r), UNICRON_AGENT_ADDR=agent.addr,
                                            UNICRON_STACK_DIR=str(stacks), UNICRON_INJECT="hang@1:1"))
            for r in (0, 1)
        ]
        for r in (0, 1):
            agent.wait_for(lambda m, r=r: m["t"] == "step" and m["rank"] == r and m["step"] == 1, 90)
        text0 = _dump_until(procs[0].pid, stacks / "rank0.txt",
                            ("in all_reduce", "torch/distributed/distributed_c10d.py", "train.py"), 30)
        text1 = _dump_until(procs[1].pid, stacks / "rank1.txt",
                            ("in hang_forever", "unicron/worker/inject.py", "train.py"), 30)
        assert all(p.poll() is None for p in procs)  # both survived their dumps
        agent.drain(0.1)
        assert max(m["step"] for m in agent.of("step")) == 1
    # rank 0 waits inside the collective for its peer; rank 1 is in unicron's injected hang
    assert "torch/distributed/distributed_c10d.py" in text0 and "train.py" in text0
    assert "unicron/worker/inject.py" in text1 and "train.py" in text1
