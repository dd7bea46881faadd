"""``unicron.State``: training state that survives a worker restart, bit for bit.

Usage::

    import unicron

    state = unicron.State(model=model, optimizer=opt, scheduler=sched, extra={"epoch": 0})
    start = state.restore()          # steps completed: 0 on a fresh start
    for step in range(start, total):
        ...                          # forward / backward / opt.step()
        state.commit(step + 1)       # "step + 1 steps completed", snapshotted before it returns

``State(extra=None, keep=3, **objects)``
    ``objects``: anything with ``state_dict()`` / ``load_state_dict()`` (model, optimizer, LR
    scheduler, GradScaler, ...), by name; ``None`` values are ignored. ``extra``: a dict of
    tensors, python scalars/strings and lists/tuples/dicts of them; it is held live, so
    ``state.extra`` (the same dict) shows restored values after ``restore()``.
``restore() -> int``
    Under a unicron restart (``UNICRON_RESTORE_STEP`` set), loads this rank's snapshot of that
    step into every object, ``extra`` and all RNG states (python ``random``, numpy's global RNG
    if numpy is used, torch CPU, CUDA if initialised) and returns the step; otherwise returns 0
    and changes nothing in the objects. The worker's step counter continues from the restored
    step. Snapshots this rank holds of later steps (the failed attempt's) are dropped.
``commit(step)``
    Copies every tensor (and the RNG states) into a slot of shared memory that stays mapped
    from one commit to the next, so the cost is one ``copy_`` per tensor on the caller's
    thread: no serialization, no background thread. Then it writes the tree as JSON next to
    it and tells the agent (``snap``); layout and protocol in ``snapslots``. CUDA tensors are
    copied device-to-host into the slot and synchronised before the snapshot is declared. Returning means
    the snapshot is complete, so it is consistent whatever the training loop does next.
    Outside unicron (no ``UNICRON_SNAPSHOT_DIR``) it only records the step.
    Each DDP's rebuilt gradient-bucket layout goes into the snapshot too; a DDP built in a
    restored worker starts with it (``unicron.worker.ddplayout``), so DDP with 3 or more ranks
    continues bit for bit.
``flush(timeout=None)``
    Kept for compatibility: commits are synchronous, nothing is ever in flight; returns True.
``step``, ``extra``, ``enabled``
    Steps completed as of the last restore/commit; the live extra dict; whether snapshots are
    being written.

A failed write (e.g. shared memory full: slot files are ``posix_fallocate``d, so a full tmpfs
is an error at sizing, never a SIGBUS on a mapped page) is reported on stderr and training goes on;
the agent then restores from the newest snapshot that was written. Refused at commit, with the
path of the offending value: anything the JSON codec (``snapcodec``) cannot give back with its
exact type (numpy scalars, arbitrary objects, sparse or quantized tensors). Restored tensors are
CPU tensors (``load_state_dict`` moves them), contiguous unless they were a dense permutation;
two entries that shared storage come back as two tensors. Not captured: where a data
loader is inside its epoch (its seed comes from the restored torch RNG when the iterator is
created); scripts that resume mid-epoch keep their batch index in ``extra``.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch

from unicron.worker import channel, ddplayout, env, hooks, snapcodec, snapshot, snapslots


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may draw from, as values ``snapcodec`` encodes."""
    version, internal, gauss = random.getstate()  # 625 ints: one tensor, not 625 JSON numbers
    rng: dict[str, Any] = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                                      "gauss": gauss},
                           "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    py = rng["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        n = rng["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


class State:
    """Training state snapshotted every step; see the module docstring."""

    def __init__(self, *, extra: dict[str, Any] | None = None, keep: int = snapshot.KEEP, **objects: Any):
        self._objects: dict[str, Any] = {}
        for name, obj in objects.items():
            if obj is None:
                continue
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"unicron.State({name}=...) needs state_dict() and load_state_dict()")
            self._objects[name] = obj
        if extra is not None and not isinstance(extra, dict):
            raise TypeError("unicron.State(extra=...) must be a dict")
        if keep < 1:
            raise ValueError("unicron.State(keep=...) must be >= 1")
        self._extra: dict[str, Any] = extra if extra is not None else {}
        self._rank = env.rank()
        self._root = env.path_or_none(env.SNAPSHOT_DIR)
        self._restore_step = env.restore_step()
        self._step = 0
        self._store = snapslots.SlotStore(snapshot.rank_dir(self._root or ".", self._rank), keep)
        self._last_error: str | None = None

    @property
    def step(self) -> int:
        return self._step

    @property
    def extra(self) -> dict[str, Any]:
        return self._extra

    @property
    def enabled(self) -> bool:
        return self._root is not None

    def __repr__(self) -> str:
        return f"unicron.State(objects={list(self._objects)}, step={self._step}, enabled={self.enabled})"

    def restore(self) -> int:
        if self._root is None:
            return 0
        step = self._restore_step or 0  # unset, or nothing completed yet: a fresh start
        path = snapshot.snapshot_path(self._root, self._rank, step)
        if step and not path.is_file():
            print(f"unicron: no snapshot {path}; starting fresh", file=sys.stderr, flush=True)
            step = 0
        if step:
            self._load(self._store.directory, step)
        self._store.prepare(newest_kept=step)  # later steps belong to the attempt that failed
        return step

    def _load(self, directory: Path, step: int) -> None:
        saved = snapslots.read(directory, step)
        if not isinstance(saved, dict) or not {"objects", "extra", "rng"} <= saved.keys():
            raise ValueError(f"{directory} holds no unicron snapshot of step {step}")
        objects = saved["objects"]
        if set(objects) != set(self._objects):
            raise ValueError(f"snapshot of step {step} in {directory} holds {sorted(objects)} "
                             f"but this State has {sorted(self._objects)}")
        for name, obj in self._objects.items():
            obj.load_state_dict(objects[name])
        self._extra.clear()
        self._extra.update(saved["extra"])
        restore_rng(saved["rng"])
        self._step = step
        hooks.set_completed_steps(step)

    def commit(self, step: int) -> None:
        step = int(step)
        self._step = step
        if self._root is None:
            return
        encoder = snapcodec.Encoder()  # refuses what it cannot give back, with its path
        tree = {
            "rank": self._rank,
            "objects": {n: encoder.encode(o.state_dict(), n) for n, o in self._objects.items()},
            "extra": encoder.encode(self._extra, "extra"),
            "rng": encoder.encode(capture_rng(), "rng"),
            # Each DDP's gradient-bucket layout: a restored DDP starts with it (bit-exact sums).
            "ddp": ddplayout.current_layouts(),
        }
        try:
            if not self._store.prepared:  # restore() was not called: nothing to continue from
                self._store.prepare(newest_kept=0)
            nbytes = self._store.write(step, tree, encoder)
        except (OSError, RuntimeError) as err:  # e.g. shm full: report once per distinct error, go on
            text = f"{type(err).__name__}: {err}"
            if text != self._last_error:
                print(f"unicron: snapshot write failed: {text}", file=sys.stderr, flush=True)
                self._last_error = text
            return
        channel.get().emit("snap", step=step, bytes=nbytes)

    def flush(self, timeout: float | None = None) -> bool:
        """Nothing to wait for: ``commit`` returns once its snapshot is complete."""
        return True
