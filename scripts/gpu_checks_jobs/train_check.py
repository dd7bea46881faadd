"""The job of gpu_checks.py's checks that run ``unicron run`` (nccl, hang, cuda-assert, crash, gpu-stuck ...).

A small MLP, gradients averaged with all_reduce, unicron.State. It writes "pre STEP TIME ATTEMPT"
just before each optimizer step; the injected fault fires in that step's hook, so the faulty
rank's last "pre" line is when the fault happened (GPU_CHECK_FAULT_RANK: the rank that hits the
device-side assert or stalls, 1 by default). Arguments: STEPS SYNC(barrier|item) ASSERT_STEP STEP_LOG_DIR.

GPU_CHECK_STALL=spin: at step GPU_CHECK_STALL_STEP of the first attempt the fault rank stalls for
real just before the step's all_reduce (on CUDA a kernel that spins on its stream for 10 minutes,
on CPU a native call that never returns). GPU_CHECK_PG_TIMEOUT: the process group's timeout in seconds.
GPU_CHECK_SAME_GPU=1: every rank on cuda:0.
"""
import os
import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import unicron

steps, sync, assert_step, log_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
cuda = os.environ["GPU_CHECK_DEVICE"] == "cuda"
fault_rank = int(os.environ.get("GPU_CHECK_FAULT_RANK", "1"))  # the rank that hits the device-side assert
stall, stall_step = os.environ.get("GPU_CHECK_STALL", ""), int(os.environ.get("GPU_CHECK_STALL_STEP", "0"))
pg_timeout = float(os.environ.get("GPU_CHECK_PG_TIMEOUT", "0"))
if cuda:
    same_gpu = os.environ.get("GPU_CHECK_SAME_GPU") == "1"
    torch.cuda.set_device(0 if same_gpu else local_rank % torch.cuda.device_count())
device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
dist.init_process_group(os.environ["GPU_CHECK_BACKEND"], **({"timeout": timedelta(seconds=pg_timeout)}
                                                             if pg_timeout else {}))


def stall_for_real(step: int) -> None:
    """Stop making progress without raising, as a rank whose GPU work never ends does."""
    log.write(f"pre {step} {time.time():.6f} {attempt}\n")  # when the stall began
    if cuda:
        torch.cuda._sleep(int(600 * 2.5e9))  # ~10 minutes of clock cycles; the host goes on until it syncs
        return
    # One native call that does not return for ages, Python still (a pure-Python loop would be
    # Python moving: work, as an evaluation is): a regular expression backtracking through 2^64 ways.
    re.match(r"(x+x+)+y", "x" * 64)

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
    if stall and rank == fault_rank and attempt == 0 and step + 1 == stall_step:
        stall_for_real(step + 1)
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
