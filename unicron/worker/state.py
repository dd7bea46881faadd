"""``unicron.State``: training state that survives a worker restart, bit for bit.

Usage::

    import unicron

    state = unicron.State(model=model, optimizer=opt, scheduler=sched, extra={"epoch": 0})
    start = state.restore()          # steps completed: 0 on a fresh start
    for step in range(start, total):
        ...                          # forward / backward / opt.step()
        state.commit(step + 1)       # "step + 1 steps completed", snapshotted asynchronously

``State(extra=None, keep=3, **objects)``
    ``objects``: anything with ``state_dict()`` / ``load_state_dict()`` (model, optimizer, LR
    scheduler, GradScaler, ...), by name; ``None`` values are ignored. ``extra``: a dict of
    tensors, python scalars/strings and lists/tuples/dicts of them; it is held live, so
    ``state.extra`` (the same dict) shows restored values after ``restore()``.
``restore() -> int``
    Under a unicron restart (``UNICRON_RESTORE_STEP`` set), loads this rank's snapshot of that
    step into every object, ``extra`` and all RNG states (python ``random``, numpy's global RNG
    if numpy is used, torch CPU, CUDA if initialised) and returns the step; otherwise returns 0
    and changes nothing. The worker's step counter continues from the restored step.
``commit(step)``
    Copies everything (and the RNG states) to CPU memory before returning, so the snapshot is
    consistent whatever the training loop does next; then a background thread ``torch.save``s
    it to ``$UNICRON_SNAPSHOT_DIR/rank{RANK}/step{step:010d}.pt`` and tells the agent
    (``snap``). A commit waits for the previous write, so at most one snapshot is in flight;
    CPU buffers are reused from one commit to the next. Outside unicron (no
    ``UNICRON_SNAPSHOT_DIR``) it only records the step.
``flush(timeout=None)``
    Waits for the write in flight (also done automatically at exit and before ``os._exit``).
``step``, ``extra``, ``enabled``
    Steps completed as of the last restore/commit; the live extra dict; whether snapshots are
    being written.

A failed write (e.g. shared memory full) is reported on stderr and training goes on; the
agent then restores from the newest snapshot that was written. Not captured: where a data
loader is inside its epoch (its seed comes from the restored torch RNG when the iterator is
created); scripts that resume mid-epoch keep their batch index in ``extra``.
"""

from __future__ import annotations

import collections
import os
import random
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from unicron.worker import channel, env, hooks, snapshot

FORMAT = 1
HARD_EXIT_FLUSH_S = 30.0  # how long os._exit waits for a snapshot write in flight
# Exact types: subclasses (numpy scalars are floats, enums are ints) pickle as their own class,
# which torch.load(weights_only=True) refuses.
_LEAF_TYPES = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.device, torch.Size}
)


class _CpuCopier:
    """Deep-copies a state tree to CPU, reusing the previous commit's tensors as buffers.

    Only types ``torch.load(weights_only=True)`` can read back are accepted; anything else
    is refused now, with its path, rather than at restore time.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._next: list[torch.Tensor] = []
        self._cuda_devices: set[torch.device] = set()

    def begin(self) -> None:
        self._next = []
        self._cuda_devices = set()

    def end(self) -> None:
        for device in self._cuda_devices:  # non_blocking copies into pinned memory: wait for them
            torch.cuda.synchronize(device)
        self._buffers = self._next

    def _tensor(self, src: torch.Tensor) -> torch.Tensor:
        src = src.detach()
        i = len(self._next)
        if src.layout != torch.strided:
            buf = src.to("cpu", copy=True)
        else:
            old = self._buffers[i] if i < len(self._buffers) else None
            pin = src.is_cuda
            if old is None or old.shape != src.shape or old.dtype != src.dtype or old.is_pinned() != pin:
                old = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            old.copy_(src, non_blocking=pin)
            if pin:
                self._cuda_devices.add(src.device)
            buf = old
        self._next.append(buf)
        return buf

    def visit(self, x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if type(x) in _LEAF_TYPES:
            return x
        if type(x) in (dict, collections.OrderedDict, collections.Counter):
            out = type(x)()
            for k, v in x.items():
                out[k] = self.visit(v, f"{path}[{k!r}]")
            if hasattr(x, "_metadata"):  # module state_dicts carry versions load_state_dict reads
                out._metadata = x._metadata  # type: ignore[attr-defined]
            return out
        if type(x) in (list, tuple, set):
            return type(x)(self.visit(v, f"{path}[{i}]") for i, v in enumerate(x))
        raise TypeError(
            f"unicron.State cannot snapshot {path} of type {type(x).__qualname__}: use tensors, "
            "python scalars/strings, and lists/tuples/dicts of them"
        )


def capture_rng() -> dict[str, Any]:
    """Every RNG state a training step may draw from, as weights_only-loadable values."""
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        rng["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "numpy" in rng:
        import numpy as np

        n = rng["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached"]))
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


class _BackgroundWriter:
    """One snapshot write at a time, on a non-daemon thread (so exit waits for it)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    def wait(self, timeout: float | None = None) -> bool:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._thread = None
        return True

    def start(self, job: Callable[[], None]) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(job,), name="unicron-snapshot")
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as err:  # report once per distinct error; training goes on
            text = f"{type(err).__name__}: {err}"
            if text != self._last_error:
                print(f"unicron: snapshot write failed: {text}", file=sys.stderr, flush=True)
                self._last_error = text


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
        self._keep = keep
        self._rank = env.rank()
        self._root = env.path_or_none(env.SNAPSHOT_DIR)
        self._restore_step = env.restore_step()
        self._step = 0
        self._copier = _CpuCopier()
        self._writer = _BackgroundWriter()
        self._cleaned = False
        if self._root is not None:
            hooks.add_hard_exit_callback(lambda code: self.flush(HARD_EXIT_FLUSH_S))

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
        if self._root is None or not self._restore_step:  # unset, or nothing completed yet
            return 0
        path = snapshot.snapshot_path(self._root, self._rank, self._restore_step)
        if not path.is_file():
            print(f"unicron: no snapshot {path}; starting fresh", file=sys.stderr, flush=True)
            return 0
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload.get("format") != FORMAT or payload.get("step") != self._restore_step:
            raise ValueError(f"{path} is not a unicron snapshot of step {self._restore_step}")
        saved = payload["objects"]
        if set(saved) != set(self._objects):
            raise ValueError(
                f"snapshot {path} holds {sorted(saved)} but this State has {sorted(self._objects)}"
            )
        for name, obj in self._objects.items():
            obj.load_state_dict(saved[name])
        self._extra.clear()
        self._extra.update(payload["extra"])
        restore_rng(payload["rng"])
        self._step = self._restore_step
        hooks.set_completed_steps(self._step)
        return self._step

    def commit(self, step: int) -> None:
        step = int(step)
        self._step = step
        if self._root is None:
            return
        self._writer.wait()  # bounded memory: one snapshot in flight, and its buffers are free
        self._copier.begin()
        payload = {
            "format": FORMAT,
            "step": step,
            "rank": self._rank,
            "objects": {n: self._copier.visit(o.state_dict(), n) for n, o in self._objects.items()},
            "extra": self._copier.visit(self._extra, "extra"),
            "rng": capture_rng(),
        }
        self._copier.end()
        directory = snapshot.rank_dir(self._root, self._rank)
        if not self._cleaned:
            directory.mkdir(parents=True, exist_ok=True)
            snapshot.remove_partial(directory)
            self._cleaned = True
        self._writer.start(lambda: self._write(payload, step))

    def _write(self, payload: dict[str, Any], step: int) -> None:
        assert self._root is not None
        final = snapshot.snapshot_path(self._root, self._rank, step)
        tmp = final.with_name(final.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, final)
        snapshot.prune(final.parent, self._keep)
        channel.get().emit("snap", step=step, bytes=final.stat().st_size)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the write in flight; False if it is still running after ``timeout``."""
        return self._writer.wait(timeout)
