"""What a snapshot every step costs, in one process: ``unicron.State`` commits, synchronous and
in the background, next to what a torchrun script does for the same guarantee (``torch.save`` of
model and optimizer every step, to tmpfs) and to no snapshot at all.

One process trains ``examples/train_gpt.py``'s model (default size, batch 8 x 64, one thread) and
switches mode every ``--block`` steps, cycling through the modes ``--cycles`` times, so every mode
sees the same machine conditions; the first two steps of each block are not counted (the switch).
Prints the median step time per mode and its ratio to "none" (steps/s relative to no snapshot).
``background`` asks for it explicitly (``State(background=True)``): on CPU the default is
synchronous, and this benchmark is why.

    .venv/bin/python scripts/bench_snapshot.py --cycles 15
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

MODES = ("none", "sync", "background", "torch.save")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=12)
    ap.add_argument("--block", type=int, default=10, help="steps per mode before switching")
    args = ap.parse_args()
    if args.cycles < 1 or args.block < 3:
        ap.error("--cycles >= 1 and --block >= 3 are required")
    root = Path(tempfile.mkdtemp(prefix="unicron-bench-snapshot-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.environ["RANK"] = "0"
    os.environ.pop("UNICRON_RESTORE_STEP", None)
    os.environ.pop("UNICRON_AGENT_ADDR", None)
    try:
        run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: Path) -> None:
    import torch
    import torch.nn.functional as F
    import train_gpt

    from unicron.worker.state import State

    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab, seq_len = 65, 64
    model = train_gpt.CharGPT(vocab, seq_len, 128, 4, 4, 0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    states = {}
    for mode, background in (("sync", False), ("background", True)):
        os.environ["UNICRON_SNAPSHOT_DIR"] = str(root / mode)  # one directory each: a State owns its slots
        states[mode] = State(model=model, optimizer=opt, background=background)
        states[mode].restore()
    x = torch.randint(0, vocab, (8, seq_len))
    y = torch.randint(0, vocab, (8, seq_len))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    n = 0
    for _ in range(args.cycles):
        for mode in MODES:
            for i in range(args.block):
                t0 = time.perf_counter()
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, vocab), y.view(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                n += 1
                if mode in states:
                    states[mode].commit(n)
                elif mode == "torch.save":
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, root / "ckpt.pt")
                if i >= 2:
                    times[mode].append(time.perf_counter() - t0)
            for state in states.values():
                state.flush()
    mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
    base = statistics.median(times["none"])
    print(f"{n} steps, {args.cycles} cycles of {args.block}-step blocks per mode; ~{mb:.1f} MB of state "
          f"(weights + AdamW moments); torch {torch.__version__}, {os.cpu_count()} CPUs")
    print()
    print("| mode | median step | steps/s vs none |")
    print("|---|---|---|")
    for mode, values in times.items():
        step = statistics.median(values)
        print(f"| {mode} | {step * 1e3:.2f} ms | {base / step:.3f} |")


if __name__ == "__main__":
    main()
