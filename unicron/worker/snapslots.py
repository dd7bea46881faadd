"""Snapshots in shared memory as ``keep`` reusable raw slots plus one JSON marker per step.

One rank's directory ``$UNICRON_SNAPSHOT_DIR/rank{R}/`` holds

``slot{k}.bin`` (k < keep)
    the tensors of one snapshot, raw, each at the offset its record names. A slot file is
    mapped once (``MAP_SHARED``) and reused: a commit is one ``copy_`` per tensor into it, no
    serialization. It is resized only when the state's total size changes. A slot that
    receives CUDA tensors is page-locked for the GPUs once (``cudadriver.register_host``), so
    the device-to-host copies into it are asynchronous DMA at full bandwidth.
``step{S:010d}.pt``
    the marker: JSON ``{"format": 2, "step", "slot", "nbytes", "tensors": [records], "tree"}``
    (``snapcodec``); ``nbytes`` is the slot's data size, what the agent reports. Its name is the one ``snapshot`` and the
    agent list as "a complete snapshot of step S".

Commit protocol (one writer: the worker that owns the directory): pick a slot (a free one,
else the one holding the oldest step; a slot that shared memory has no room for is given up,
and fewer snapshots are kept); unlink that step's marker *before* touching the slot;
copy every tensor in; write the marker to ``step{S:010d}.pt.tmp`` and rename it. So a marker
that exists always describes a slot that holds exactly its data, and a worker killed
mid-copy leaves a slot no marker points at. tmpfs needs no fsync: the files live as long as
the machine, not the process, which is all snapshots must outlive.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from unicron.worker import cudadriver, snapcodec, snapshot

FORMAT = 2


def slot_name(slot: int) -> str:
    return f"slot{slot}.bin"


def choose_slot(held: Mapping[int, int], slots: Sequence[int], step: int) -> int:
    """Slot for a snapshot of ``step``: the one already holding ``step`` (committed again), else
    the first free one of ``slots``, else the one holding the oldest step. ``held``: slot -> step."""
    for slot, held_step in held.items():
        if held_step == step:
            return slot
    for slot in slots:
        if slot not in held:
            return slot
    return min(held, key=lambda s: (held[s], s))


def read_marker(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        marker = json.load(f)
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ValueError(f"{path} is not a unicron snapshot marker (format {FORMAT})")
    return marker


FAIR_SLOTS = 2  # snapshots each rank of a node is left room for before any keeps more (``_map``)


class SlotStore:
    """The writer side of one rank's snapshot directory."""

    def __init__(self, directory: Path, keep: int, *, peers: int = 0) -> None:
        self.directory = directory
        self.keep = keep
        # The node's other ranks, whose snapshots share this shared memory (see ``_map``).
        self.peers = peers
        self._held: dict[int, int] = {}  # slot -> step of the live marker pointing at it
        self._usable = list(range(keep))  # slots not given up for want of shared memory
        self.notice: str | None = None  # for the user, once: fewer snapshots kept than asked
        self._maps: dict[int, torch.Tensor] = {}  # slot -> uint8 view of its mapped file
        self._views: dict[int, tuple[snapcodec.Layout, list[torch.Tensor]]] = {}  # slot -> its views
        self._layout: snapcodec.Layout | None = None  # of the last commit: reused while specs match
        self._pinned: set[int] = set()  # slots page-locked for the GPUs (``_pin``)
        self._pin_tried: set[int] = set()
        self.pin_error: str | None = None  # why the last slot could not be page-locked
        self.prepared = False

    def prepare(self, newest_kept: int) -> None:
        """Adopt what a previous process of this rank left: drop partial markers and markers
        of steps after ``newest_kept`` (another attempt's future: mixing them with this
        attempt's steps could pair ranks from different timelines), learn which slot each
        remaining marker holds."""
        self.directory.mkdir(parents=True, exist_ok=True)
        snapshot.remove_partial(self.directory)
        self._held.clear()
        for step in snapshot.list_steps(self.directory):
            path = self.directory / snapshot.snapshot_name(step)
            try:
                slot = read_marker(path).get("slot")
            except (OSError, ValueError):
                slot = None
            if step > newest_kept or not (isinstance(slot, int) and 0 <= slot < self.keep) \
                    or slot in self._held:
                _unlink(path)
            else:
                self._held[slot] = step
        self.prepared = True

    def write(self, step: int, tree: Any, encoder: snapcodec.Encoder) -> int:
        """Store ``tree`` (what ``encoder`` returned) as step ``step``; returns its data bytes."""
        pending = self.stage(step, tree, encoder, deferred=())
        pending.finish()
        return pending.nbytes

    def stage(self, step: int, tree: Any, encoder: snapcodec.Encoder,
              deferred: Collection[int]) -> PendingSnapshot:
        """First half of a write, on the caller's thread: take a slot and copy every tensor but
        those whose indices are in ``deferred``; ``finish()`` on the result copies those and
        publishes the marker. Nothing else may touch this store until it has finished."""
        tree_json = json.dumps(tree, allow_nan=False, separators=(",", ":"))  # may fail: before any change
        layout = self._layout
        if layout is None or layout.specs != encoder.specs:
            layout = self._layout = snapcodec.Layout(encoder.specs)
        if not self.directory.is_dir():  # removed under the running job (a cleanup script, an epilog)
            self._recreate()
        slot, views = self._take_slot(step, layout)
        if slot not in self._pin_tried and views and any(t.is_cuda for t in encoder.tensors):
            self._pin(slot)
        now, later = _split(len(encoder.tensors), deferred) if views else ([], [])
        _copy([views[i] for i in now], [encoder.tensors[i] for i in now])
        head = json.dumps({"format": FORMAT, "step": step, "slot": slot, "nbytes": layout.nbytes})
        text = f'{head[:-1]},"tensors":{layout.records_json},"tree":{tree_json}}}'
        return PendingSnapshot(self, step, slot, layout.nbytes, text,
                               [views[i] for i in later], [encoder.tensors[i] for i in later])

    def _recreate(self) -> None:
        """Make the directory again and forget what it held: the slots mapped still exist, but
        the agent can no longer find them, so they are dropped and written afresh."""
        lost = self.held_steps
        for slot in list(self._maps):
            self._unmap(slot)
        self._held.clear()
        self._usable = list(range(self.keep))
        for directory in (self.directory.parent, self.directory):  # private, as the agent made them
            directory.mkdir(mode=0o700, exist_ok=True)
        gone = f" (the snapshots of steps {lost[0]}-{lost[-1]} are gone)" if lost else ""
        self.notice = f"{self.directory} was removed while the job ran; made it again{gone}"

    @property
    def held_steps(self) -> list[int]:
        return sorted(self._held.values())

    def _take_slot(self, step: int, layout: snapcodec.Layout) -> tuple[int, list[torch.Tensor]]:
        """A slot for ``step``, mapped for ``layout``. A slot whose pages shared memory cannot
        reserve is given up, and the snapshot goes to the oldest slot left: fewer snapshots
        kept, each still complete (two alternate, so a kill mid-copy leaves the step before),
        rather than every later commit failing at the same full slot."""
        while True:
            slot = choose_slot(self._held, self._usable, step)
            if slot in self._held:  # its data is about to be overwritten: no marker may point at it
                _unlink(self.directory / snapshot.snapshot_name(self._held.pop(slot)))
            try:
                return slot, self._slot_views(slot, layout)
            except OSError as err:
                self._unmap(slot)  # free what it holds: the slot has no marker now
                _unlink(self.directory / slot_name(slot))
                if err.errno != errno.ENOSPC or len(self._usable) == 1:
                    raise
                self._usable.remove(slot)
                self.notice = (f"shared memory has room for only {len(self._usable)} of this rank's "
                               f"{self.keep} snapshots ({layout.nbytes / 1e6:.1f} MB each): keeping "
                               f"{len(self._usable)}")
                if len(self._usable) < FAIR_SLOTS:
                    self.notice += (" (a restart restores from memory only where every rank holds the step "
                                    "this one does; give /dev/shm more room: docker run --shm-size)")

    def _publish(self, step: int, slot: int, text: str) -> None:
        final = self.directory / snapshot.snapshot_name(step)
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, final)
        self._held[slot] = step

    def _slot_views(self, slot: int, layout: snapcodec.Layout) -> list[torch.Tensor]:
        if layout.nbytes == 0:
            return []
        cached = self._views.get(slot)
        if cached is not None and cached[0] is layout:
            return cached[1]
        data = self._map(slot, layout.nbytes)
        views = [tensor_view(data, r) for r in layout.records]
        self._views[slot] = (layout, views)
        return views

    def _map(self, slot: int, total: int) -> torch.Tensor:
        data = self._maps.get(slot)
        if data is not None and data.numel() == total:
            return data
        self._unmap(slot)  # before resizing (a shrunk mapping faults past its end)
        path = self.directory / slot_name(slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size > total:
                os.ftruncate(fd, total)
            elif size < total:
                # Ranks in lockstep share a complete step once each keeps two snapshots (a kill
                # lands at most one commit behind its peers); a slot beyond a rank's second is
                # taken only where every other rank of the node still has room for two. Where
                # the ranks took slots first come, one kept 3 and its peer 1, and half the
                # restarts found no step every rank held (acceptance 27B F2).
                fair = self.peers * FAIR_SLOTS * total if len(self._maps) >= FAIR_SLOTS else 0
                if on_shared_memory(fd):  # elsewhere (a directory on disk) the job needs no room left
                    check_headroom(os.fstatvfs(fd), total - size + fair, total)
            # reserve the pages now: a full tmpfs is then an OSError here, not a SIGBUS mid-copy
            os.posix_fallocate(fd, 0, total)
        finally:
            os.close(fd)
        data = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        self._maps[slot] = data
        return data

    def _pin(self, slot: int) -> None:
        """Page-lock a slot that receives CUDA tensors, once: device-to-host copies into pageable
        memory go through a bounce buffer at a fraction of the bandwidth and block the copying
        thread. Where the driver refuses, the slot stays pageable (slower, still correct)."""
        self._pin_tried.add(slot)
        rc = cudadriver.register_host(self._maps[slot].data_ptr(), self._maps[slot].numel())
        if rc == cudadriver.CUDA_SUCCESS:
            self._pinned.add(slot)
        else:
            self.pin_error = f"cuMemHostRegister of slot {slot} failed with CUresult {rc}"

    def _unmap(self, slot: int) -> None:
        self._views.pop(slot, None)
        self._pin_tried.discard(slot)
        data = self._maps.pop(slot, None)
        if data is not None and slot in self._pinned:  # unregistered while still mapped
            self._pinned.discard(slot)
            cudadriver.unregister_host(data.data_ptr())


def headroom_bytes(fs_bytes: int, slot_bytes: int) -> int:
    """Shared memory snapshots leave free (pure): a quarter of the file system, and never less
    than two slots' worth. The job itself needs ``/dev/shm``: a DataLoader's workers pass every
    batch through it, NCCL's intra-node transport too; a container's default is 64 MB."""
    return max(fs_bytes // 4, 2 * slot_bytes)


def on_shared_memory(fd: int, shm: str = "/dev/shm") -> bool:
    """Whether the file ``fd`` is on ``/dev/shm``'s file system (the agent's snapshots are; a
    directory on disk given by UNICRON_SNAPSHOT_DIR is not, and a quarter of a disk that is
    three quarters full is nothing the job's DataLoaders need: tests failed so)."""
    try:
        return os.fstat(fd).st_dev == os.stat(shm).st_dev
    except OSError:  # no /dev/shm: nothing to leave room in
        return False


def check_headroom(vfs: os.statvfs_result, growth: int, slot_bytes: int) -> None:
    """Raise ENOSPC (as a full file system would) when growing a slot by ``growth`` bytes would
    leave less than ``headroom_bytes`` free; the caller keeps fewer snapshots, or none."""
    fs_bytes, free = vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize
    keep = headroom_bytes(fs_bytes, slot_bytes)
    if free - growth < keep:
        # Where the room to leave is more than there is (27B F9: "8 of 8 MB free, and 25 MB stay
        # free"), the rule is said as a rule.
        left = (f"{keep / 1e6:.0f} MB stay free" if keep < fs_bytes else
                "a quarter of it, and at least two snapshots' worth, stays free")
        raise OSError(errno.ENOSPC, f"shared memory too small for a {slot_bytes / 1e6:.1f} MB snapshot: "
                                    f"{free / 1e6:.0f} of {fs_bytes / 1e6:.0f} MB free, and {left} "
                                    "for the job's own use (DataLoader workers, NCCL); give the "
                                    "container more (docker run --shm-size, or --ipc=host)")


class PendingSnapshot:
    """A staged snapshot: ``finish()`` copies the deferred tensors and publishes the marker."""

    def __init__(self, store: SlotStore, step: int, slot: int, nbytes: int, marker: str,
                 views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        self.store, self.step, self.slot, self.nbytes = store, step, slot, nbytes
        self._marker, self._views, self._sources = marker, views, sources
        # Deferred CUDA sources were produced on the committing thread's streams; the copy,
        # on another thread, starts once they are done (an event per device, recorded now).
        self._ready = {t.device: _record_event(t.device) for t in sources if t.is_cuda}

    def finish(self) -> None:
        if self._ready:
            # A new thread's current device is 0: make it the state's own, or the first CUDA
            # call here (and every stream switch back) would create a context on GPU 0.
            torch.cuda.set_device(next(iter(self._ready)))
        for event in self._ready.values():
            event.synchronize()
        # Copies from the device go on a stream of their own: the device's other streams carry
        # the next step's work, which this copy must neither wait for nor hold up.
        _copy(self._views, self._sources, streams={d: _side_stream(d) for d in self._ready})
        self._views = self._sources = []  # drop the references: the training loop owns them
        self.store._publish(self.step, self.slot, self._marker)


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def _record_event(device: torch.device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _split(n: int, deferred: Collection[int]) -> tuple[list[int], list[int]]:
    if not deferred:
        return list(range(n)), []
    later = set(deferred)
    return [i for i in range(n) if i not in later], sorted(later)


def _copy(views: list[torch.Tensor], tensors: list[torch.Tensor],
          streams: Mapping[torch.device, Any] | None = None) -> None:
    """Copy ``tensors`` into ``views``; device-to-host copies have landed when it returns, on
    ``streams[device]`` if given (only those are waited for), else on the current stream."""
    if not views:
        return
    with torch.no_grad():  # a source that requires grad must not make the slot part of a graph
        if not any(src.is_cuda for src in tensors):
            torch._foreach_copy_(views, tensors)  # one call: no per-tensor Python overhead
            return
        devices: set[torch.device] = set()
        for view, src in zip(views, tensors, strict=True):
            if not src.is_cuda:
                view.copy_(src)
                continue
            devices.add(src.device)
            if streams:
                with torch.cuda.stream(streams[src.device]):
                    view.copy_(src, non_blocking=True)
            else:
                view.copy_(src, non_blocking=True)
    for device in devices:  # device-to-host copies must have landed before the marker says "complete"
        if streams:
            streams[device].synchronize()
        else:
            torch.cuda.synchronize(device)


def tensor_view(data: torch.Tensor, record: Mapping[str, Any]) -> torch.Tensor:
    """The contiguous tensor a record describes, viewing ``data`` (uint8) at its offset."""
    dtype = snapcodec.dtype_from_name(record["dtype"])
    offset, nbytes, shape = int(record["offset"]), int(record["nbytes"]), [int(n) for n in record["shape"]]
    numel = 1
    for n in shape:
        numel *= n
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes != numel * itemsize or offset < 0 or offset % snapcodec.ALIGN or offset + nbytes > data.numel():
        raise ValueError(f"tensor record {dict(record)} does not fit a {data.numel()}-byte slot")
    return data[offset:offset + nbytes].view(dtype).view(shape)


def read(directory: Path, step: int) -> Any:
    """The tree committed as step ``step``, its tensors copied out (nothing stays mapped)."""
    path = directory / snapshot.snapshot_name(step)
    marker = read_marker(path)
    total = marker.get("nbytes")
    if marker.get("step") != step or not isinstance(total, int) or "tree" not in marker:
        raise ValueError(f"{path} is not a unicron snapshot of step {step}")
    data = torch.empty(0, dtype=torch.uint8)
    if total:
        slot_path = directory / slot_name(int(marker["slot"]))
        if os.path.getsize(slot_path) < total:
            raise ValueError(f"{slot_path} is shorter than the {total} bytes {path} describes")
        data = torch.from_file(str(slot_path), shared=False, size=total, dtype=torch.uint8)

    records = marker.get("tensors")
    if not isinstance(records, list):
        raise ValueError(f"{path} is not a unicron snapshot of step {step}")

    def load(i: int) -> torch.Tensor:
        record = records[i]
        view = tensor_view(data, record)
        if "stride" not in record:
            return view.clone()
        out = torch.empty_strided(view.shape, [int(s) for s in record["stride"]], dtype=view.dtype)
        return out.copy_(view)

    try:
        return snapcodec.decode(marker["tree"], load)
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"{path}: malformed snapshot metadata ({type(err).__name__}: {err})") from None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
