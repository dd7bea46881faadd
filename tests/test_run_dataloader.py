"""End to end: a rank waiting for its data loader is not a hang of its peers' collective.

A streaming dataset's read can stall for seconds (a new shard opened over the network, NFS)
while the other ranks, already done with their batch, wait for it in the gradient all-reduce.
torchrun waits; unicron must too, up to its busy threshold, and still call a loader stuck for
good a hang, naming the rank that waits for it."""

from __future__ import annotations

import pytest
from e2e import read_events, run_unicron

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

# Rank 0's read of item STALL_AT blocks for STALL_S (forever if negative) in a loader worker:
# idle, no CPU, no I/O, as a network read does. Steps are torch.optim steps (counted).
SCRIPT = """
import sys, time
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

STALL_AT, STALL_S, PREFETCH = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "thread"
dist.init_process_group("gloo")
rank = dist.get_rank()

class Stream(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        if rank == 0 and i == STALL_AT:
            time.sleep(STALL_S if STALL_S >= 0 else 3600)
        time.sleep(0.02)
        return torch.full((8,), float(i))

def batches():
    loader = DataLoader(Stream(), batch_size=None, num_workers=2)
    if not PREFETCH:
        yield from loader
        return
    import queue, threading  # a prefetching thread iterates the loader; the main thread waits on it
    ready = queue.Queue(maxsize=2)
    threading.Thread(target=lambda: ([ready.put(b) for b in loader], ready.put(None)), daemon=True).start()
    while (batch := ready.get()) is not None:
        yield batch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x in batches():
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
print(f"rank {rank} done w={model.weight.sum().item():.6f}", flush=True)
dist.destroy_process_group()
"""

COMMON = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "0", "--grace-period", "2",
          "--hang-floor", "1", "--hang-warmup-steps", "3"]


def _run(workdir, stall_s: float, *flags: str, iterate: str = "main") -> tuple[int, str, list[dict]]:
    (workdir / "stream.py").write_text(SCRIPT)
    code, out, err = run_unicron(["run", *COMMON, "--log-dir", str(workdir / "logs"), *flags,
                                  str(workdir / "stream.py"), "20", str(stall_s), iterate], workdir, timeout=120)
    return code, out + err, read_events(workdir / "logs")


@pytest.mark.parametrize("iterate", ["main", "thread"])
def test_a_read_that_stalls_past_the_idle_floor_is_waited_for(tmp_path, iterate: str) -> None:
    # 3 s, three times the idle floor: under the busy threshold (10 s), as the rank waits for
    # data, whether the main thread iterates the loader or a prefetching thread does.
    code, text, events = _run(tmp_path, 3.0, iterate=iterate)
    assert code == 0, text[-3000:]
    assert not [e for e in events if e["kind"] == "fault"], text[-3000:]
    assert text.count(" done w=") == 2


def test_a_loader_stuck_for_good_is_still_a_hang(tmp_path) -> None:
    code, text, events = _run(tmp_path, -1, "--hang-busy-floor", "4")
    assert code != 0
    hangs = [e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hangs, text[-3000:]
    assert "busy" in hangs[0]["message"], hangs[0]  # held to the busy threshold, not the idle one
    decisions = [e for e in events if e["kind"] == "decision"]
    assert decisions and "culprit rank(s) 0" in decisions[0]["reason"], decisions


SLOW_RUN = """
import time
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

dist.init_process_group("gloo")
rank = dist.get_rank()

class Reads(Dataset):  # storage slow for a while: rank 0's reads 10-16 each take 1.3 s
    def __len__(self):
        return 20

    def __getitem__(self, i):
        if rank == 0 and 10 <= i < 17:
            time.sleep(1.3)
        return torch.full((8,), float(i))

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for x in DataLoader(Reads(), batch_size=None, num_workers=0):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


def test_a_run_of_slow_reads_is_waited_for_not_only_the_first(tmp_path) -> None:
    """Once most recent steps were slow, the worker's own idea of a usual step is long: it must
    still report its wait for data before the agent's idle threshold (from its 50-step median)
    runs out (acceptance pass 15: the sixth slow read in a row was called a hang)."""
    (tmp_path / "slow_run.py").write_text(SLOW_RUN)
    code, out, err = run_unicron(["run", *COMMON, "--log-dir", str(tmp_path / "logs"), str(tmp_path / "slow_run.py")],
                                 tmp_path, timeout=120)
    assert code == 0, err[-3000:]
    assert not [e for e in read_events(tmp_path / "logs") if e["kind"] == "fault"], err[-3000:]
    assert (out + err).count(" done") == 2
