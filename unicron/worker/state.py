"""``unicron.State``: training state that survives a worker restart, bit for bit.

Usage::

    import unicron

    state = unicron.State(model=model, optimizer=opt, scheduler=sched, extra={"epoch": 0})
    start = state.restore()          # steps completed: 0 on a fresh start
    for step in range(start, total):
        ...                          # forward / backward / opt.step()
        state.commit(step + 1)       # "step + 1 steps completed"

``State(extra=None, keep=3, background=None, **objects)``
    ``objects``: anything with ``state_dict()`` / ``load_state_dict()`` (model, optimizer, LR
    scheduler, GradScaler, ...), or a random generator the script owns (``torch.Generator``,
    ``numpy.random.Generator`` or ``RandomState``, ``random.Random``: ``unicron.worker.generators``), by name;
    ``None`` values are ignored. ``extra``: a dict of
    tensors, python scalars/strings and lists/tuples/dicts of them; it is held live and
    restored in place: ``state.extra`` (the same dict) shows restored values after
    ``restore()``, and so do the script's own names for its tensors, lists and dicts (a tensor
    of another shape, a number, a string is replaced). ``background``:
    whether commits finish in the background (below); ``None`` (default): when the state is
    on a GPU. ``keep``: snapshots each rank holds; with several ranks keep at least 2 (ranks
    commit one after another, so a fault between two ranks' commits can leave each holding a
    different single step): ``keep=1`` is said once on rank 0.
``restore() -> int``
    Under a unicron restart (``UNICRON_RESTORE_STEP`` set), loads this rank's snapshot of that
    step into every object, ``extra`` and all RNG states (python ``random``, numpy's global RNG
    if numpy is used, torch CPU, CUDA if initialised) and returns the step; otherwise returns 0
    and changes nothing in the objects. The worker's step counter continues from the restored
    step. Snapshots this rank holds of later steps (the failed attempt's) are dropped.
``restore_step -> int``
    The step ``restore()`` will load (0: a fresh start), before it is called: a script whose
    objects change during the run (a head added, layers unfrozen into a new param group at step
    K) builds them as they were at that step, then calls ``restore()``.
``commit(step)``
    A restore resumes right after the commit it restores: code after ``commit(S)`` in the same
    iteration (an evaluation at step S) is not run again for S when the failure came there.
    ``step`` counts the steps completed over the whole run: it must not go back (a per-epoch
    counter would have the agent restore the newest step, another epoch's). Snapshots the
    state as it is now into a slot of shared memory that stays mapped from one
    commit to the next (layout and protocol in ``snapslots``), in two halves. On the caller's
    thread: every ``state_dict()``, the RNG states, the tree (JSON), and a copy of every tensor
    that the next iteration may change before its optimizer step (buffers such as BatchNorm
    statistics, ``extra``, the RNG states). In the background (``snapwriter``): the copy of the
    optimizers' parameters and state tensors, which only ``optimizer.step()`` changes, then the
    marker that declares the snapshot complete (the next step message names it). So the big
    device-to-host copy runs on a CUDA stream of its own while the next forward and backward
    run, and a global optimizer step pre-hook waits for it before any optimizer changes what it
    copies. At most one snapshot is in flight; the next commit waits for it. A background
    commit is in flight until its copy lands (a few milliseconds into the next step): a
    worker killed in that window is restored from the snapshot before, so the step whose
    commit was in flight is redone with the one that was running. Either way at most one
    completed step is lost, the same bound as a kill that lands between two ranks' commits
    of one step (the agent restores the newest step every rank holds).

    **Synchronous on CPU** (``background=None`` with CPU tensors): the copy would compete for the
    cores it overlaps, and measured it bought nothing reliable (docs/benchmarks.md "Snapshot
    cost") while opening that window; ``background=True`` asks for the background half anyway.
    Outside unicron (no ``UNICRON_SNAPSHOT_DIR``) it only records the step. The first commit
    of a fresh start warns (rank 0) of what is left out of it: an LR scheduler, an optimizer that stepped (``leftout``).
    Each DDP's rebuilt gradient-bucket layout goes into the snapshot too; a DDP built in a
    restored worker starts with it (``unicron.worker.ddplayout``), so DDP with 3 or more ranks
    continues bit for bit. DDP rebuilds its buckets at its second forward, so the commit after
    a fresh DDP's first iteration writes no snapshot (its layout is not known yet; a restored
    one's is): a failure before the next commit restarts from the script's start.
``flush(timeout=None) -> bool``
    Waits until the last commit's snapshot is complete (False if ``timeout`` passed first).
    Needed only with a background commit, before changing parameters or optimizer state in place *outside*
    ``optimizer.step()`` right after a commit (e.g. ``model.load_state_dict``, a manual weight
    clamp before the next step). A normal exit and ``os._exit`` flush by themselves.
``step``, ``extra``, ``enabled``
    Steps completed as of the last restore/commit; the live extra dict; whether snapshots are
    being written.

Misuses a restart would only repeat raise ``unicron.StateError`` (a ``ValueError``; its
``SnapshotTypeError`` is also a ``TypeError``), and the job stops on them at any step instead
of restarting: a step that goes back, a snapshot of other objects than this State holds (names
must be the same in every attempt), a ``ZeroRedundancyOptimizer`` (its ``state_dict()`` is a
collective that gathers every shard on one rank: pass ``zero.optim``, this rank's shard, which
restores bit for bit), and two States in one process taking turns at one rank's
snapshots (they would overwrite each other's steps: give one State every object).

A failed write (e.g. shared memory full: slot files are ``posix_fallocate``d, so a full tmpfs
is an error at sizing, never a SIGBUS on a mapped page) is reported on stderr once per kind of
error (by the next commit or flush when the background half failed), saying which step a
restart would go back to, and training goes on; the agent then restores from the newest
snapshot that was written. Shared memory with room for fewer than ``keep`` snapshots keeps as
many as fit (said once); a rank directory removed under the running job is made again. Refused at commit, with the
path of the offending value: anything the JSON codec (``snapcodec``) cannot give back with its
exact type (numpy scalars, arbitrary objects, sparse or quantized tensors). A DTensor (FSDP2's
``fully_shard``, tensor parallelism) is snapshotted as this rank's local tensor and its global
shape, and restored with the mesh and placements of the live object (``unicron.worker.shards``:
a module's entry of the same key, an optimizer's state by its parameter), so build and shard the
model and the optimizer before ``restore()``, as the script does anyway. Restored tensors are
CPU tensors (``load_state_dict`` moves them), contiguous unless they were a dense permutation;
two entries that shared storage come back as two tensors. Not captured: where a data loader
is inside its epoch (keep the batch index in ``extra``); the draws a ``DataLoader`` iterator
makes at its creation, from the global RNG or its ``generator=``, are replayed for the iterator
a restored worker creates (``unicron.worker.loaders``, which says where that is not exact).
"""

from __future__ import annotations

import atexit
import functools
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from unicron.worker import (
    ddplayout,
    env,
    generators,
    hooks,
    inplace,
    leftout,
    loaders,
    shards,
    snapcodec,
    snapshot,
    snapslots,
    snapwriter,
)
from unicron.worker.errors import SnapshotTypeError, StateError
from unicron.worker.globalrng import capture_rng, restore_rng
from unicron.worker.stepnumber import step_number

# Ranks commit one after another: a kill between two ranks' commits of step N leaves one holding
# only N and another only N-1 with a single slot each, and no step every rank holds (33A F3).
KEEP_ONE_WARNING = ("unicron: State(keep=1) with several ranks: a fault that lands between two ranks' commits "
                    "leaves no step that every rank holds, and the restart starts from the script's own start; "
                    "keep at least 2 (the default is 3)")
EXIT_WAIT_S = 10.0  # longest an exiting worker waits for its snapshot in flight

# Rank directory -> the State that last restored or committed into it. Two live States that
# take turns would overwrite each other's steps, and a restore would pair one State's objects
# with the other's snapshot: the one that was taken over is refused at its next commit.
_writers: dict[str, weakref.ref[State]] = {}


def _flush_at_exit(*_: Any) -> None:
    """A normal exit and ``os._exit`` wait for the snapshots in flight (a kill cannot)."""
    snapwriter.flush_all(EXIT_WAIT_S)


atexit.register(_flush_at_exit)
hooks.add_hard_exit_callback(_flush_at_exit)


class State:
    """Training state snapshotted every step; see the module docstring."""

    def __init__(self, *, extra: dict[str, Any] | None = None, keep: int = snapshot.KEEP,
                 background: bool | None = None, **objects: Any):
        self._objects: dict[str, Any] = {}
        for name, obj in objects.items():
            if obj is None:
                continue
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                wrapped = generators.as_stateful(obj)  # a random generator the script owns
                if wrapped is None:  # a StateError: the job stops at once, a restart would only repeat it
                    raise SnapshotTypeError(f"unicron.State({name}=...) needs an object with state_dict() and "
                                            "load_state_dict() (a model, an optimizer, a scheduler), or a random "
                                            "generator (torch.Generator, numpy.random.Generator or RandomState, "
                                            f"random.Random); got {type(obj).__qualname__}")
                obj = wrapped
            if type(obj).__name__ == "ZeroRedundancyOptimizer":
                # Its state_dict() gathers every rank's shard on one rank (a collective, and an
                # error on the others); a snapshot is per rank, and this rank's shard is the inner one.
                raise StateError(f"unicron.State({name}=...): a ZeroRedundancyOptimizer's state_dict() is a "
                                 f"collective that consolidates all shards; pass its rank-local optimizer "
                                 f"instead: unicron.State({name}={name}.optim, ...)")
            self._objects[name] = obj
        # StateErrors: the job stops at once, a restart would only repeat them.
        if extra is not None and not isinstance(extra, dict):
            raise SnapshotTypeError(f"unicron.State(extra=...) must be a dict; got {type(extra).__qualname__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise StateError(f"unicron.State(keep=...) must be an int >= 1; got {keep!r}")
        if keep < snapslots.FAIR_SLOTS and env.world_size() > 1 and env.path_or_none(env.SNAPSHOT_DIR) \
                and env.restart_count() == 0:  # once per job
            _say_on_rank_0(env.rank(), KEEP_ONE_WARNING)
        self._extra: dict[str, Any] = extra if extra is not None else {}
        self._rank = env.rank()
        self._root = env.path_or_none(env.SNAPSHOT_DIR)
        self._restore_step = env.restore_step()
        self._step = 0
        self._store = snapslots.SlotStore(snapshot.rank_dir(self._root or ".", self._rank), keep,
                                          peers=env.local_world_size() - 1)
        self._last_error: str | None = None
        self._background = background
        self._memo: dict[Any, tuple[Any, Any]] = {}  # the encoder's, kept from commit to commit
        self._wrote = False  # has restored or committed into its rank directory
        self._unrestored: int | None = None  # the first commit's step, when restore() did not come first
        # Under unicron only: it watches zero_grad() and the optimizers' steps
        self._accumulation = leftout.AccumulationCheck(self._objects if self._root else {},
                                                       say=functools.partial(_say_on_rank_0, self._rank))
        self._checked = False  # objects left out of this State: looked for at the first commit
        self._writer = snapwriter.Writer()
        snapwriter.install_fence()
        if self._root is not None:
            loaders.install()  # a restored data loader draws what the interrupted one drew
            hooks.note_state()

    @property
    def step(self) -> int:
        return self._step

    @property
    def extra(self) -> dict[str, Any]:
        return self._extra

    @property
    def enabled(self) -> bool:
        return self._root is not None

    @property
    def restore_step(self) -> int:
        """The step ``restore()`` will load (0: a fresh start), known before it is called: a
        script whose objects change during the run (a head added, layers unfrozen into a new
        param group at step K) builds them as they were at that step first."""
        if self._root is None or not self._restore_step:
            return 0
        return self._restore_step if snapshot.snapshot_path(self._root, self._rank, self._restore_step).is_file() else 0

    def __repr__(self) -> str:
        return f"unicron.State(objects={list(self._objects)}, step={self._step}, enabled={self.enabled})"

    def restore(self) -> int:
        self._writer.wait()
        if self._root is None:
            return 0
        if self._unrestored is not None:  # the snapshot to restore was let go at that commit (27C F6)
            raise StateError(f"unicron.State.restore() after commit({self._unrestored}): call restore() "
                             "before the first commit(), which starts from what it restored")
        self._take_directory(taking_over=True)
        step = self._restore_step or 0  # unset, or nothing completed yet: a fresh start
        path = snapshot.snapshot_path(self._root, self._rank, step)
        if step and not path.is_file():
            print(f"unicron: no snapshot {path}; starting fresh", file=sys.stderr, flush=True)
            step = 0
        if step:
            self._load(self._store.directory, step)
            self._checked = True  # the attempt that started fresh warned already (31A F5: every attempt did)
        self._store.prepare(newest_kept=step)  # later steps belong to the attempt that failed
        return step

    def _load(self, directory: Path, step: int) -> None:
        saved = snapslots.read(directory, step)
        if not isinstance(saved, dict) or not {"objects", "extra", "rng"} <= saved.keys():
            raise ValueError(f"{directory} holds no unicron snapshot of step {step}")
        objects = saved["objects"]
        if set(objects) != set(self._objects):
            raise StateError(f"unicron.State: the snapshot of step {step} in {directory} holds "
                             f"{sorted(objects)} but this State has {sorted(self._objects)} (the same names "
                             "must be passed to State() in every attempt)")
        for name, obj in self._objects.items():
            try:
                obj.load_state_dict(shards.place_shards(name, objects[name], obj))  # DTensors: placed as the live ones
            except StateError:
                raise
            except (RuntimeError, ValueError, KeyError, TypeError) as err:  # every restart would fail the same way
                said = " ".join(str(err).split())
                raise StateError(f"unicron.State: the snapshot of step {step} does not fit {name!r} as it is now "
                                 f"(was the script changed between attempts, or did {name!r} change during the "
                                 f"run? build it as it was at step {step} before restore(): State.restore_step "
                                 f"says which step is restored): {said[:600]}") from err
        # Into what the script holds: it keeps using its own names for extra's tensors, lists
        # and dicts (momentum buffers, an EMA), as for its model.
        inplace.restore_into(self._extra, saved["extra"])
        restore_rng(saved["rng"])
        loaders.arm(saved.get("loaders"))
        self._step = step
        hooks.set_completed_steps(step)

    def commit(self, step: int) -> None:
        step = step_number(step)
        if step < self._step:  # the agent restores the newest step: a smaller one would be lost
            raise StateError(f"unicron.State.commit({step}) after step {self._step}: the step must not go back; "
                             "pass the steps completed over the whole run, not within an epoch")
        self._writer.wait()  # the previous snapshot (normally done long ago, during this step)
        self._report_failure()
        self._step = step
        if self._root is None:
            return
        self._take_directory(taking_over=False)
        self._accumulation.at_commit(step)
        if not self._checked and self._rank == 0:  # once per job: not by every rank, nor after a restore
            for warning in (leftout.schedulers_left_out(self._objects)
                            + leftout.optimizers_left_out(self._objects, hooks.built_optimizers())
                            + leftout.ddp_without_hooks(self._objects, ddplayout.tracked)):
                print(warning, file=sys.stderr, flush=True)
        self._checked = True
        if ddplayout.rebuild_pending():  # after a DDP's first iteration: no exact restore possible yet
            return
        encoder = snapcodec.Encoder(self._memo)  # refuses what it cannot give back, with its path
        try:
            tree = {
                "rank": self._rank,
                "objects": {n: encoder.encode(o.state_dict(), n) for n, o in self._objects.items()},
                "extra": encoder.encode(self._extra, "extra"),
                "rng": encoder.encode(capture_rng(), "rng"),
                # Where each data loader's epoch began: its iterator, re-created after a restore, draws the same.
                "loaders": encoder.encode(loaders.mid_epoch(), "loaders"),
                # Each DDP's gradient-bucket layout: a restored DDP starts with it (bit-exact sums).
                "ddp": ddplayout.current_layouts(),
            }
        except RecursionError:  # the script's mistake, as any refused type: not a restart's (27C F10)
            raise SnapshotTypeError("unicron.State cannot snapshot its objects or extra: they hold themselves (a "
                                    "cycle) or are nested too deep; use tensors, python scalars/strings, and "
                                    "lists/tuples/dicts of them") from None
        background = self._background
        if background is None:  # see "Synchronous on CPU" in the module docstring
            background = any(t.is_cuda for t in encoder.tensors)
        later: list[int] = []
        if background:
            try:
                owned = self._optimizer_owned()
                later = [i for i, t in enumerate(encoder.tensors) if t.data_ptr() in owned]
            except (AttributeError, TypeError, RuntimeError):  # an unusual optimizer: copy it all now
                later = []
            background = bool(later)  # nothing to overlap: no reason to leave a window open
        try:
            if not self._store.prepared:  # restore() was not called: nothing to continue from
                if self.restore_step and self._rank == 0:  # the console said "restoring": say it did not
                    print(f"unicron: State.restore() was not called before commit({step}): step "
                          f"{self._restore_step} was in memory, this run started from the script's own start",
                          file=sys.stderr, flush=True)
                self._store.prepare(newest_kept=0)
                self._unrestored = step
            pending = self._store.stage(step, tree, encoder, later)
            if self._store.notice:
                print(f"unicron: rank {self._rank}: {self._store.notice}", file=sys.stderr, flush=True)
                self._store.notice = None
            if not background:
                self._finish(pending)
                return
        except (OSError, RuntimeError) as err:  # e.g. shm full: report once per distinct error, go on
            self._report_failure(err)
            return
        self._writer.submit(lambda: self._finish(pending))

    def _take_directory(self, *, taking_over: bool) -> None:
        """Become the State writing this rank's snapshots. ``restore()`` takes over (a new
        timeline starts); a commit is refused if another live State took over since this
        one last wrote."""
        key = str(self._store.directory)
        held = _writers.get(key)
        other = held() if held is not None else None
        if other is not None and other is not self and self._wrote and not taking_over:
            raise StateError(f"unicron.State: two States take turns at rank {self._rank}'s snapshots, "
                             "overwriting each other's; give one State every object (State(model=a, model2=b))")
        if other is not self:
            _writers[key] = weakref.ref(self)
        self._wrote = True

    def _finish(self, pending: snapslots.PendingSnapshot) -> None:
        """The background half of a commit (``snapwriter``)."""
        pending.finish()
        hooks.note_snapshot(pending.step)

    def _optimizer_owned(self) -> set[int]:
        """Data pointers of what only ``optimizer.step()`` changes: every parameter and state
        tensor of the optimizers in this State. Their copy may finish in the background."""
        owned: set[int] = set()
        for obj in self._objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                for group in obj.param_groups:
                    owned.update(p.data_ptr() for p in group["params"])
                for per_param in obj.state.values():
                    owned.update(v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
        owned.discard(0)  # empty tensors: nothing to copy, and they would all match
        return owned

    def _report_failure(self, err: BaseException | None = None) -> None:
        err = err or self._writer.take_error()
        if err is None:
            return
        text = f"{type(err).__name__}: {err}"
        kind = f"{type(err).__name__} {getattr(err, 'errno', '')}"  # not the text: it names each step's file
        if kind != self._last_error:  # once per kind of error: training goes on
            # Said once, so say what it costs until commits succeed again.
            held = self._store.held_steps
            back = f"step {held[-1]}" if held else "the script's own start"
            print(f"unicron: snapshot write failed: {text}; until a snapshot is written again, "
                  f"a restart goes back to {back}", file=sys.stderr, flush=True)
            self._last_error = kind

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the last commit's snapshot is complete; False if ``timeout`` s passed first.
        Call it before changing parameters or optimizer state in place outside
        ``optimizer.step()`` (e.g. ``model.load_state_dict``) right after a commit."""
        done = self._writer.wait(timeout)
        if done:
            self._report_failure()
        return done


def _say_on_rank_0(rank: int, text: str) -> None:
    if rank == 0:  # every rank sees the same: rank 0 says it
        print(text, file=sys.stderr, flush=True)
