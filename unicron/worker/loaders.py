"""A restored worker's data loader draws what the interrupted one drew (torch's global RNG).

Creating a ``torch.utils.data.DataLoader`` iterator draws from torch's global RNG: the seed of
its workers (``_base_seed``, every iterator) and, for a ``RandomSampler`` without a generator,
the epoch's shuffle. In a run without faults those draws happened when the epoch began, before
the steps whose RNG states (dropout, ...) a ``unicron.State`` snapshot holds. A restored worker
that resumes mid-epoch creates its iterator *after* ``restore()``: the same draws would then
come out of the restored stream, shifting every later random number (dropout differs, the run
is no longer bit-exact) and giving the epoch another seed.

So, with ``unicron.State`` in use, every ``DataLoader.__iter__`` notes the global RNG state just
before it; a commit saves that state for each loader whose latest iterator is mid-epoch (it has
yielded and is not exhausted: at an epoch's end the next epoch's iterator draws from the
restored stream, as it did without the fault; a script that, restored at the very end of an
epoch, makes that epoch's iterator again only to skip all of it draws once too often), with a
fingerprint of the loader (dataset type, length, batch size, workers, sampler type);
``restore()`` arms them, and the first ``__iter__`` of a loader with the same fingerprint runs
under the saved state, after which the restored state is put back. The new iterator draws
exactly what the interrupted one drew, and training continues from the restored stream.

A loader with ``persistent_workers`` makes its iterator once and resets it each epoch (no new
worker seed): it is always saved, and its replay is of the state before its *first* iterator,
which gives the same worker seed and, with a sampler that draws nothing from the global RNG
(``DistributedSampler``, ``SequentialSampler``, a seeded generator), the same epoch. Its
worker processes, though, are new: restored after its first epoch, they draw from their seed
again where the interrupted ones had drawn through every earlier epoch, so random transforms in
the dataset differ from then on; a warning says so at the restore (``persistent_workers=False``
makes new workers every epoch, as the restored run does, and is bit-exact). A
``RandomSampler`` that shuffles under ``persistent_workers`` (from the global RNG or the loader's
generator) gets the first epoch's order after a restore in a later one. A loader given its own
``generator=`` draws the seed and the shuffle from it: its state before the iterator is recorded
and replayed too, and the generator is left where the replayed draws leave it, as it was in the
run before the fault; once its iterator is done (an epoch's end), the generator's state at the
commit is recorded, which the next epoch's iterator draws from (acceptance 26B F2: restored at an
epoch's end, a generator left out of the State shuffled the next epoch as the first). Where the batches of the epoch come from
is the script's business (it skips what it consumed, e.g. with a batch index in
``State(extra=...)``); a ``num_workers=0`` loader whose dataset draws random numbers in the
training process draws them again as the script skips, and is not bit-exact after a restore.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any

import torch

from unicron.worker import env

# An RNG record: torch's global RNG state, and the loader's own ``generator=``'s (None without one).
Draws = tuple[torch.Tensor, torch.Tensor | None]
_latest: dict[int, tuple[weakref.ref[Any], Draws, list[Any]]] = {}  # loader -> its iterator
_first: dict[int, Draws] = {}  # loader -> the RNG states before its first iterator
_armed: list[tuple[Draws, list[Any], int]] = []  # restored: (RNG states, fingerprint, epochs)
_epochs: dict[int, int] = {}  # loader -> iterators made (a persistent loader's: epochs begun)
_generators: dict[int, weakref.ref[torch.Generator]] = {}  # loader -> its own ``generator=``
_count = 0
_installed = False


def fingerprint(loader: Any) -> list[Any]:
    length: int | None = None
    dataset = loader.dataset
    if not isinstance(dataset, torch.utils.data.IterableDataset):  # len() of one makes torch warn later
        try:
            length = len(dataset)
        except Exception:  # noqa: BLE001 - a dataset's own error
            length = None
    return [type(loader.dataset).__qualname__, length, loader.batch_size, loader.num_workers,
            type(loader.sampler).__qualname__, bool(loader.persistent_workers and loader.num_workers > 0)]


def install() -> None:
    """Wrap ``DataLoader.__iter__`` (once per process)."""
    global _installed
    if _installed:
        return
    from torch.utils.data import DataLoader

    original = DataLoader.__iter__

    def __iter__(self: Any) -> Any:
        try:
            key = self.__dict__.get("_unicron_loader")
            if key is None:
                key = self.__dict__["_unicron_loader"] = _next_key()
            mark = fingerprint(self)
            gen = self.generator if isinstance(getattr(self, "generator", None), torch.Generator) else None
            before: Draws = (torch.get_rng_state(), gen.get_state() if gen is not None else None)
        except Exception:  # noqa: BLE001 - bookkeeping must never stop a training loop
            return original(self)
        taken = _take(mark)
        replay = taken[0] if taken is not None else None
        made_under = before if replay is None else replay  # what this iterator draws from
        _epochs[key] = taken[1] if taken is not None else _epochs.get(key, 0) + 1
        if taken is not None and mark[-1] and taken[1] > 1:
            _warn_persistent(taken[1])
        if replay is None:
            it = original(self)
        else:
            torch.set_rng_state(replay[0])
            if gen is not None and replay[1] is not None:
                # The loader's own generator draws its workers' seed and its shuffle: from where
                # the interrupted iterator drew them. It is left where that iterator's draws
                # leave it, as it was in the run before the fault.
                gen.set_state(replay[1])
            try:
                it = original(self)
                try:
                    _start_sampler(it)
                except Exception:  # noqa: BLE001 - the sampler's own error comes at the first next()
                    pass
            finally:
                torch.set_rng_state(before[0])  # training goes on from the restored stream
        # A replay stands for the interrupted run's first iterator too (its base of record).
        first = _first[key] = made_under if replay is not None else _first.get(key, made_under)
        try:
            _latest[key] = (weakref.ref(it), first if mark[-1] else made_under, mark)  # mark[-1]: persistent
        except TypeError:  # an iterator without weak references (a subclass's own): not recorded
            pass
        if gen is not None:
            _generators[key] = weakref.ref(gen)
        return it

    __iter__.__wrapped__ = original  # type: ignore[attr-defined]
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    _installed = True


def _start_sampler(it: Any) -> None:
    """A single-process iterator's sampler draws its shuffle at the first batch, not when the
    iterator is made (workers prefetch at once): take its first indices now, under the replayed
    state, as the first ``next`` of the interrupted run did right after ``iter``."""
    sampler_iter = getattr(it, "_sampler_iter", None)
    if getattr(it, "_num_workers", None) != 0 or sampler_iter is None:
        return
    try:
        first = next(sampler_iter)
    except StopIteration:
        return
    it._sampler_iter = itertools.chain([first], sampler_iter)


def _next_key() -> int:
    global _count
    _count += 1
    return _count


def _take(mark: list[Any]) -> tuple[Draws, int] | None:
    for i, (state, armed_mark, epochs) in enumerate(_armed):
        if armed_mark == mark:
            del _armed[i]
            return state, epochs
    return None


def _warn_persistent(epoch: int) -> None:
    # Its worker processes are new: they start again from their seed, where the interrupted
    # ones had drawn through every earlier epoch (random transforms in the dataset). Every rank
    # restores its loader alike: rank 0 says it, as the State's other warnings (31A F5).
    if env.rank() != 0:
        return
    print(f"unicron: a DataLoader with persistent_workers was restored in its epoch {epoch}: its new worker "
          "processes start from their seed, so random numbers they draw (random transforms) differ from the "
          "run before the restart; for a bit-exact restore use persistent_workers=False", file=sys.stderr,
          flush=True)


def mid_epoch() -> list[dict[str, Any]]:
    """For a snapshot: the loaders whose latest iterator has yielded and is not exhausted,
    every persistent loader's, the next iterator of those with their own generator, and the
    restored records not replayed yet."""
    out = []
    for key in sorted(_latest):
        ref, state, mark = _latest[key]
        it = ref()
        gen = _generators[key]() if key in _generators else None
        yielded = getattr(it, "_num_yielded", 0) if it is not None else 0
        try:
            total: int | None = len(it) if it is not None else 0
        except Exception:  # noqa: BLE001 - as in fingerprint
            total = None
        # A persistent loader's iterator is made once in a run without faults: any iterator a
        # restored worker makes is one more, whatever the epoch.
        if it is not None and (mark[-1] or (yielded > 0 and (total is None or yielded < total))):
            out.append(_record(state, mark, _epochs.get(key, 1)))
        elif gen is not None and (it is None or yielded > 0):
            # Done with (exhausted, or dropped): its next iterator draws its shuffle from its own
            # generator as it is now. A restored script's generator, left out of the State, is
            # back at its seed and would shuffle the next epoch as the first (acceptance 26B F2).
            out.append(_record((torch.get_rng_state(), gen.get_state()), mark, _epochs.get(key, 1) + 1))
    # Restored records whose loader has not made its iterator yet (a commit came first): the
    # next restore still owes it that draw.
    out.extend(_record(state, mark, epochs) for state, mark, epochs in _armed)
    return out


def _record(draws: Draws, mark: list[Any], epochs: int) -> dict[str, Any]:
    record = {"rng": draws[0], "fingerprint": mark, "epochs": epochs}
    if draws[1] is not None:
        record["generator"] = draws[1]
    return record


def arm(records: Any) -> None:
    """After a restore: the first iterator of each matching loader replays its record."""
    _armed.clear()
    if not isinstance(records, list):
        return
    for record in records:
        if isinstance(record, dict) and isinstance(record.get("rng"), torch.Tensor) \
                and isinstance(record.get("fingerprint"), list):
            epochs = record.get("epochs")
            gen = record.get("generator")
            _armed.append(((record["rng"], gen if isinstance(gen, torch.Tensor) else None), record["fingerprint"],
                           epochs if type(epochs) is int else 1))
