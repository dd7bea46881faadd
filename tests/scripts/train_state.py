"""A tiny data-parallel training job that opts in to unicron.State (test workload).

Per-parameter all_reduce keeps the update bit-exact for any world size after a restore.
Rank 0 writes the sha256 of the final parameters to --out.
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist

import unicron

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--out", default="")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--no-state", action="store_true")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = None if args.no_state else unicron.State(model=model, optimizer=opt)
start = state.restore() if state is not None else 0
print(f"rank {rank} starts at step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    if state is not None:
        state.commit(step + 1)
    if args.sleep:
        time.sleep(args.sleep)
if rank == 0 and args.out:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(args.out, "w") as fh:
        fh.write(digest)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
