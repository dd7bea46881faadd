"""Train a small character-level GPT on Shakespeare with DDP; heals under ``unicron run``.

Runs unchanged under every launcher::

    python examples/train_gpt.py --steps 20                                  # one process
    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --steps 50
    unicron run --standalone --nproc-per-node 2 examples/train_gpt.py --steps 50

Backend: gloo on CPU, NCCL on GPU (device ``cuda:LOCAL_RANK``). Rank 0 prints the loss of every
step; with ``--out`` it saves the final ``state_dict`` and every run prints ``sha256 <hex>`` of
the parameters, so two runs can be compared bit for bit.

State that survives a failure
-----------------------------
The script opts in to unicron's worker API with three lines (``unicron.State``, ``restore()``,
``commit()``): under ``unicron run`` a restarted worker continues from the last committed step
held in the agent's memory. Under torchrun (or without unicron installed) ``restore()`` returns
0 and ``commit()`` does nothing. ``--ckpt-dir DIR --ckpt-every K`` adds classic disk
checkpoints (rank 0 writes, every rank resumes from the newest one), the torchrun way.

Determinism
-----------
The batch of a step is drawn from a ``torch.Generator`` seeded from (seed, step, rank), so
resuming needs no data-loader state, and dropout is off by default. A resumed run therefore
reproduces the uninterrupted run bit for bit in these cases:

* ``--no-ddp``, any world size: gradients are averaged with one ``all_reduce`` per parameter,
  so every reduction has the same shape and order in every run.
* DDP with 2 ranks: each element is reduced as the sum of exactly two values, and floating
  point addition of two values is commutative, so the order of the ring does not matter.
* DDP with more ranks, restored by ``unicron run`` from its ``unicron.State`` snapshot: DDP's
  first iteration uses its initial gradient buckets (parameters in reverse registration order)
  and then rebuilds them in the order gradients became ready; the bucket layout changes the
  chunks of the ring all-reduce and so the order in which three or more values are summed.
  unicron records the rebuilt layout in each snapshot and gives it to the restored DDP.
  Resuming from a disk checkpoint (``--ckpt-dir``) with 3 or more DDP ranks may differ in the
  last bits.

Faults for benchmarks (``--fault KIND@RANK:STEP``) fire only on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0 or unset) and write the wall time to ``--fault-stamp`` just
before they happen, so a benchmark knows when a fault happened under any launcher.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

try:
    import unicron
except ImportError:  # plain torchrun on a machine without unicron
    unicron = None  # type: ignore[assignment]

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "shakespeare.txt"
FAULT_KINDS = ("kill", "exception", "hang", "exit")


class Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, n_layer: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="non-zero breaks bit-exact resume")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="UTF-8 text file")
    p.add_argument("--out", type=Path, help="rank 0 saves the final state_dict here")
    p.add_argument("--ckpt-dir", type=Path, help="disk checkpoints: resume from the newest one")
    p.add_argument("--ckpt-every", type=int, default=0, help="save a disk checkpoint every K steps")
    p.add_argument("--no-ddp", action="store_true", help="per-parameter all_reduce (exact resume, any size)")
    p.add_argument("--no-state", action="store_true", help="do not use unicron.State even under unicron")
    p.add_argument("--sample", type=int, default=0, help="rank 0 prints N generated characters at the end")
    p.add_argument("--step-log", type=Path, help="every rank appends 'step unix_time attempt' lines here")
    p.add_argument("--fault", help="KIND@RANK:STEP, KIND in kill|exception|hang|exit (first attempt only)")
    p.add_argument("--fault-stamp", type=Path, help="file that gets the wall time of the --fault")
    args = p.parse_args(argv)
    if args.steps < 0 or args.batch_size < 1 or args.seq_len < 2 or args.ckpt_every < 0:
        p.error("--steps >= 0, --batch-size >= 1, --seq-len >= 2, --ckpt-every >= 0 are required")
    if args.d_model % args.n_head:
        p.error("--d-model must be a multiple of --n-head")
    if args.ckpt_every and args.ckpt_dir is None:
        p.error("--ckpt-every needs --ckpt-dir")
    if args.fault is not None:
        args.fault = parse_fault(p, args.fault)
    return args


def parse_fault(p: argparse.ArgumentParser, spec: str) -> tuple[str, int, int]:
    try:
        kind, where = spec.split("@", 1)
        rank, step = (int(x) for x in where.split(":", 1))
    except ValueError:
        p.error(f"--fault {spec!r}: expected KIND@RANK:STEP")
    if kind not in FAULT_KINDS:
        p.error(f"--fault kind {kind!r}: expected one of {', '.join(FAULT_KINDS)}")
    return kind, rank, step


def batch_seed(seed: int, step: int, rank: int) -> int:
    """A generator seed per (seed, step, rank): data needs no loader state to resume."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def get_batch(data: torch.Tensor, args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch_seed(args.seed, step, rank))
    starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), generator=gen)
    x = torch.stack([data[s : s + args.seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + 1 + args.seq_len] for s in starts.tolist()])
    return x, y


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def average_gradients(model: nn.Module, world_size: int) -> None:
    """One all_reduce per parameter, always the same shapes: bit-exact across restarts."""
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step*.pt"))
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"step{step:08d}.pt"
    tmp = final.with_suffix(".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}, tmp)
    os.replace(tmp, final)  # a checkpoint that exists is complete


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> int:
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"])


def maybe_fault(args: argparse.Namespace, rank: int, step: int) -> None:
    """Make the requested failure really happen at the start of `step` (1-based), once."""
    if args.fault is None or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    kind, fault_rank, fault_step = args.fault
    if rank != fault_rank or step != fault_step:
        return
    if args.fault_stamp is not None:
        args.fault_stamp.write_text(f"{time.time():.6f}\n")
    print(f"[rank {rank}] injecting fault {kind} at step {step}", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "exception":
        raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected at step {step})")
    elif kind == "exit":
        os._exit(3)
    while True:  # hang: peers block in their next collective
        time.sleep(3600)


@torch.no_grad()
def sample(model: nn.Module, itos: list[str], n: int, seq_len: int, device: torch.device) -> str:
    idx = torch.zeros((1, 1), dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(idx[:, -seq_len:])[:, -1, :]
        idx = torch.cat([idx, logits.argmax(dim=-1, keepdim=True)], dim=1)
    return "".join(itos[i] for i in idx[0].tolist())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    world_size = dist.get_world_size() if distributed else 1

    text = args.data.read_text(encoding="utf-8")
    itos = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(itos)}
    data = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model = CharGPT(len(itos), args.seq_len, args.d_model, args.n_layer, args.n_head, args.dropout).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    state_cls = None if args.no_state else getattr(unicron, "State", None)  # None: unicron not installed
    state = state_cls(model=model, optimizer=opt, extra={"seed": args.seed}) if state_cls else None

    start = state.restore() if state is not None else 0
    if start == 0 and args.ckpt_dir is not None and (ckpt := latest_checkpoint(args.ckpt_dir)) is not None:
        start = load_checkpoint(ckpt, model, opt, device)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"world {world_size} params {n_params / 1e6:.2f}M resume_from {start} device {device}", flush=True)
    ddp = distributed and not args.no_ddp
    net: nn.Module = DistributedDataParallel(model, device_ids=[local_rank] if use_cuda else None) if ddp else model

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    step_log = None
    if args.step_log is not None:
        args.step_log.mkdir(parents=True, exist_ok=True)
        step_log = open(args.step_log / f"rank{rank}.txt", "a", buffering=1)  # noqa: SIM115
    # cosine decay to 10% so the default run visibly learns; a function of the step only
    min_lr = args.lr * 0.1

    for step in range(start, args.steps):
        maybe_fault(args, rank, step + 1)
        t0 = time.perf_counter()
        lr = min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * step / max(1, args.steps)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = (t.to(device) for t in get_batch(data, args, step, rank))
        logits = net(x)
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if distributed and not ddp:
            average_gradients(model, world_size)
        opt.step()
        if state is not None:
            state.commit(step + 1)
        if rank == 0 and args.ckpt_dir is not None and args.ckpt_every and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(args.ckpt_dir, step + 1, model, opt)
        if step_log is not None:
            step_log.write(f"{step + 1} {time.time():.6f} {attempt}\n")
        if rank == 0:
            ms = (time.perf_counter() - t0) * 1e3
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} {ms:.1f} ms", flush=True)

    if rank == 0:
        if args.sample:
            print(sample(model, itos, args.sample, args.seq_len, device), flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), args.out)
        print(f"sha256 {params_sha256(model)}", flush=True)
    if step_log is not None:
        step_log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        dist.destroy_process_group()
    # gloo can abort during interpreter teardown after a clean run; leave without teardown
    os._exit(0)


if __name__ == "__main__":
    main()
