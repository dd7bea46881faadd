"""FSDP2 (fully_shard) with unicron.State: sharded model, optimizer and scheduler snapshotted every
step; writes a digest of each rank's local state to OUT.rank<R> (usage: train_fsdp.py STEPS OUT)."""

import hashlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import unicron

steps, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
state = unicron.State(model=model, optimizer=opt, scheduler=sched)
torch.manual_seed(1000 + rank)  # each rank's data; a restore brings back the RNG state of its step
start = state.restore()
for step in range(start, steps):
    opt.zero_grad()
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    sched.step()
    state.commit(step + 1)
digest = hashlib.sha256()
for value in model.state_dict().values():
    digest.update(value.to_local().detach().contiguous().numpy().tobytes())
for per_param in opt.state_dict()["state"].values():
    for value in per_param.values():
        local = value.to_local() if hasattr(value, "to_local") else value
        digest.update(local.detach().contiguous().numpy().tobytes())
with open(f"{out}.rank{rank}", "w") as fh:
    fh.write(digest.hexdigest())
