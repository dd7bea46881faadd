"""A tiny data-parallel training job that opts in to unicron.State (test workload).

Per-parameter all_reduce keeps the update bit-exact for any world size after a restore.
Rank 0 writes the sha256 of the final parameters to --out.
"""

import argparse
import hashlib
import os
import sys
import time

import psutil
import torch
import torch.distributed as dist

import unicron

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--out", default="")
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--no-state", action="store_true")
# A long phase between steps on one rank (an evaluation), while the others wait in a barrier:
# --pause KIND@RANK:STEP:SECONDS[,...], KIND eval (forward passes, as an evaluation loop), io (writing
# a file, little CPU), native (one long C call while the process computes, as a spin-wait), calls
# (short C calls one after another, as an evaluation that is one big op per batch) or
# helper (a helper process computes while the worker waits for it, as a data loader's workers)
# or thread (eval on a thread pool while the main thread waits for it).
parser.add_argument("--pause", default="")
# --fail-after-restore RANK: that rank raises right after restoring, in the first restart only
parser.add_argument("--fail-after-restore", type=int, default=-1)
# --hang-after-restore RANK: that rank sleeps right after restoring, in the first restart only
# (its peers wait in the first step's all_reduce: every rank idle before the attempt's first step)
parser.add_argument("--hang-after-restore", type=int, default=-1)
# --pause-after-restore KIND: rank 0, in the first restart only, spends 8 x the first attempt's
# start-up (at least 14 s) in a pause of that KIND (above, or "loader": waiting for a data
# loader's worker that sleeps) before its first step, while its peers wait in that step
parser.add_argument("--pause-after-restore", default="")
# --pause-at-start KIND:SECONDS: rank 0 of the first attempt pauses so before its first step (a
# preprocessing, a baseline evaluation) while its peers wait in that step
parser.add_argument("--pause-at-start", default="")
# --raise-after-step RANK:STEP: that rank raises after STEP's optimizer step, before its commit,
# in every attempt (a loss check that fails the same way after each exact restore)
parser.add_argument("--raise-after-step", default="")
# --payload N: also all_reduce N floats each step (network traffic, for a slow link)
parser.add_argument("--payload", type=int, default=0)
args = parser.parse_args()


def pause(kind: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    if kind == "eval":
        batch = torch.ones(64, 8)
        with torch.no_grad():
            while time.monotonic() < end:
                model(batch)
        return
    if kind == "thread":
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            pool.submit(pause, "eval", seconds).result()
        return
    if kind == "calls":  # C calls one after another (one big op per evaluation batch)
        import hashlib

        while time.monotonic() < end:
            hashlib.pbkdf2_hmac("sha256", b"unicron", b"salt", 20_000)
        return
    if kind == "native":  # one long C call, the process burning CPU meanwhile (a CUDA spin-wait)
        import hashlib
        import threading

        done = threading.Event()

        def spin() -> None:
            while not done.is_set():
                hashlib.pbkdf2_hmac("sha256", b"unicron", b"salt", 20_000)

        spinner = threading.Thread(target=spin, daemon=True)
        spinner.start()
        # The main thread: one C call, never back in Python meanwhile (not a wait on the
        # spinning thread: a main thread blocked on a thread that computes is a pool at work).
        time.sleep(seconds)
        done.set()
        spinner.join()
        return
    if kind == "loader":
        class Slow(torch.utils.data.Dataset):
            def __len__(self) -> int:
                return 1

            def __getitem__(self, i: int) -> torch.Tensor:
                time.sleep(seconds)  # a slow remote read: no CPU, no I/O counted
                return torch.zeros(1)

        next(iter(torch.utils.data.DataLoader(Slow(), num_workers=1)))
        return
    if kind == "helper":
        import subprocess

        spin = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
        subprocess.run([sys.executable, "-c", spin], check=True)
        return
    chunk = os.urandom(1 << 20)
    with open(f"{args.out or 'pause'}.scratch", "wb") as fh:
        while time.monotonic() < end:
            for _ in range(4):
                fh.write(chunk)
            fh.flush()
            fh.seek(0)
            time.sleep(0.2)  # about 20 MiB/s with a few percent of a core



dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = None if args.no_state else unicron.State(model=model, optimizer=opt)
start = state.restore() if state is not None else 0
print(f"rank {rank} starts at step {start} (restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')})", flush=True)
if rank == args.fail_after_restore and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    raise RuntimeError(f"failing on purpose right after restoring step {start}")
if rank == args.hang_after_restore and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    time.sleep(3600)
startup_file = f"{args.out or 'train'}.startup"
if rank == 0 and args.pause_after_restore and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "1":
    with open(startup_file) as fh:
        pause(args.pause_after_restore, max(8 * float(fh.read()), 14.0))
if rank == 0 and args.pause_at_start and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    kind, seconds = args.pause_at_start.split(":")
    pause(kind, float(seconds))
for step in range(start, args.steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 8, generator=g)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    if args.payload:
        dist.all_reduce(torch.ones(args.payload))
    opt.step()
    if step == start and rank == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
        with open(startup_file, "w") as fh:
            fh.write(f"{time.time() - psutil.Process().create_time():.3f}")  # since its fork
    if args.raise_after_step and args.raise_after_step == f"{rank}:{step + 1}":
        raise RuntimeError(f"loss check failed after step {step + 1}")
    if state is not None:
        state.commit(step + 1)
    if args.sleep:
        time.sleep(args.sleep)
    for spec in filter(None, args.pause.split(",")):
        kind, where = spec.split("@")
        prank, pstep, seconds = where.split(":")
        if step + 1 == int(pstep):
            if prank == "*" or rank == int(prank):  # "*": every rank (a sharded checkpoint)
                pause(kind, float(seconds))
            dist.barrier()
if rank == 0 and args.out:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    with open(args.out, "w") as fh:
        fh.write(digest)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
