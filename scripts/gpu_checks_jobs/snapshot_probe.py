"""Run by gpu_checks.py snapshot: unicron.State with the model on the GPU (CPU without one).

Checks that a background commit (the default for GPU state) holds exactly the committed values
although the next step runs while its device-to-host copy is in flight, and measures steps per
second with no snapshot, synchronous commits and background commits, one mode after another in
blocks. Prints one JSON line."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from unicron.worker import snapslots
from unicron.worker.state import State

BLOCK, CYCLES = 10, 5


def main() -> int:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    root = tempfile.mkdtemp(prefix="unicron-snapshot-probe-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.environ["RANK"] = "0"
    os.environ.pop("UNICRON_RESTORE_STEP", None)
    try:
        torch.manual_seed(0)
        width = 2048 if device.type == "cuda" else 256
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(512, width, device=device)

        def train_step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            opt.step()

        states = {}
        # GPU state commits in the background by default; CPU state is asked to
        for mode, background in (("sync", False), ("background", None if device.type == "cuda" else True)):
            os.environ["UNICRON_SNAPSHOT_DIR"] = os.path.join(root, mode)  # one directory each: a State owns its slots
            states[mode] = State(model=model, optimizer=opt, background=background)
        exact = []
        state = states["background"]
        state.restore()
        for step in (1, 2, 3):
            train_step()
            # clones on the device, queued behind the optimizer step: nothing waits for the GPU
            # before commit(), so only the event recorded there orders the background copy
            committed = {k: v.detach().clone() for k, v in model.state_dict().items()}
            moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
            state.commit(step)
            train_step()  # runs while the copy may be in flight; its optimizer step waits for it
            state.flush()
            saved = snapslots.read(state._store.directory, step)["objects"]
            exact.append(all(torch.equal(saved["model"][k], v.cpu()) for k, v in committed.items())
                         and all(torch.equal(saved["optimizer"]["state"][i]["exp_avg"], m.cpu())
                                 for i, m in enumerate(moments)))
        # Two step lengths for the same state: the copy (state / device-to-host bandwidth) is
        # hidden only behind a step longer than it.
        batches = (512, 8192) if device.type == "cuda" else (512,)
        runs = []
        n = 10
        for batch in batches:
            x = torch.randn(batch, width, device=device)
            times: dict[str, list[float]] = {"none": [], "sync": [], "background": []}
            for _ in range(CYCLES):
                for mode in times:
                    chosen = states.get(mode)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(BLOCK):
                        train_step()
                        n += 1
                        if chosen is not None:
                            chosen.commit(n)
                    if chosen is not None:
                        chosen.flush()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times[mode].append((time.perf_counter() - t0) / BLOCK)
            step_s = {mode: statistics.median(v) for mode, v in times.items()}
            runs.append({"batch": batch, "step_ms": {k: round(v * 1e3, 3) for k, v in step_s.items()},
                         "ratio_sync": round(step_s["none"] / step_s["sync"], 3),
                         "ratio_background": round(step_s["none"] / step_s["background"], 3)})
        state_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3 / 1e6
        stores = {mode: st._store for mode, st in states.items()}
        print(json.dumps({"device": str(device), "state_mb": round(state_mb, 1), "exact": exact, "runs": runs,
                          **{k: runs[0][k] for k in ("step_ms", "ratio_sync", "ratio_background")},
                          "pinned_slots": {m: sorted(s._pinned) for m, s in stores.items()},
                          "pin_error": {m: s.pin_error for m, s in stores.items()}}))
        return 0 if all(exact) else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
