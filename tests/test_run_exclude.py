"""An elastic job leaves out a node whose ranks fail again in the same place after a restart,
and finishes on the others (three agents on loopback, real gloo)."""

from __future__ import annotations

import socket

import pytest
from e2e import clean_env, read_events, wait_for
from test_run_mesh import SECRET, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

SCRIPT = """
import os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if os.environ.get("BROKEN_NODE"):  # this node's device is broken: it fails the same way every time
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(str(dist.get_world_size()))
dist.destroy_process_group()
"""


def test_a_node_that_fails_again_in_place_is_left_out_and_the_job_finishes(workdir, launch) -> None:
    # The job forms once all three have joined (MAX ends the last call at once): a long last
    # call keeps a loaded machine's slow launcher from joining late, as a grow (one more restart).
    (workdir / "broken.py").write_text(SCRIPT)
    port = free_port()
    args = ["run", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "excl", "--rdzv-conf", "last_call_timeout=30", "--max-restarts", "4",
            "--grace-period", "2", "--log-dir", str(workdir / "logs"), str(workdir / "broken.py"),
            str(workdir / "world.txt")]
    host = launch(args, workdir, clean_env(UNICRON_SECRET=SECRET))  # hosts the coordinator: never left out
    wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 60, "the coordinator to listen")
    good = launch(args, workdir, clean_env(UNICRON_SECRET=SECRET))
    broken = launch(args, workdir, clean_env(UNICRON_SECRET=SECRET, BROKEN_NODE="1"))
    code, _out, err = broken.wait(180)
    assert code == 4, err
    assert "left out of job excl" in err and "CUDA error" in err, err
    for item in (host, good):
        code, _out, err = item.wait(120)
        assert code == 0, err
    assert (workdir / "world.txt").read_text() == "2"  # finished on the two good nodes
    events = read_events(workdir / "logs")
    decisions = [e["action"] for e in events if e["kind"] == "decision"]
    assert decisions == ["restart", "reconfigure"], decisions
    excluded = [e for e in events if e["kind"] == "node_excluded"]
    assert len(excluded) == 1 and "failed again" in excluded[0]["reason"], excluded
    starts = [e["world_size"] for e in events if e["kind"] == "attempt_start"]
    assert starts == [3, 3, 2], starts
