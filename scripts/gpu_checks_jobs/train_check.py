"""The job of gpu_checks.py's checks nccl, hang, hang-item, cuda-assert and crash.

A small MLP, gradients averaged with all_reduce, unicron.State. It writes "pre STEP TIME ATTEMPT"
just before each optimizer step; the injected fault fires in that step's hook, so the faulty
rank's last "pre" line is when the fault happened (GPU_CHECK_FAULT_RANK: the rank that hits the
device-side assert, 1 by default). Arguments: STEPS SYNC(barrier|item) ASSERT_STEP STEP_LOG_DIR.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import unicron

steps, sync, assert_step, log_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
cuda = os.environ["GPU_CHECK_DEVICE"] == "cuda"
fault_rank = int(os.environ.get("GPU_CHECK_FAULT_RANK", "1"))  # the rank that hits the device-side assert
if cuda:
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
dist.init_process_group(os.environ["GPU_CHECK_BACKEND"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
state = unicron.State(model=model, optimizer=opt)
start = state.restore()
log = open(os.path.join(log_dir, f"rank{rank}.txt"), "a", buffering=1)
print(f"rank {rank} on {device} over {dist.get_backend()}, attempt {attempt} from step {start}", flush=True)
for step in range(start, steps):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    log.write(f"pre {step + 1} {time.time():.6f} {attempt}\n")
    if rank == fault_rank and attempt == 0 and step + 1 == assert_step:
        # Index 5 of 2: on CUDA the bounds check of the index kernel is a device-side assert.
        # (No error words on the failing line: the classifier reads a traceback's source lines.)
        print(torch.zeros(2, device=device)[torch.tensor([5], device=device)])
        torch.cuda.synchronize() if cuda else None
    opt.step()
    state.commit(step + 1)
    dist.barrier() if sync == "barrier" else loss.item()
    time.sleep(0.02)
dist.barrier()
print(f"rank {rank} done at step {steps}", flush=True)
dist.destroy_process_group()
