"""A data loader iterator made after a restore draws what the interrupted one drew."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from unicron.worker import loaders

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _clean() -> None:
    loaders.install()
    loaders._armed.clear()
    loaders._latest.clear()
    loaders._first.clear()
    loaders._epochs.clear()
    loaders._generators.clear()


def _epoch(persistent: bool = False, workers: int = 0) -> DataLoader[torch.Tensor]:
    return DataLoader(torch.arange(32.0), batch_size=4, shuffle=True, num_workers=workers,
                      persistent_workers=persistent)


def test_a_mid_epoch_record_replays_the_shuffle_and_leaves_the_stream_alone() -> None:
    torch.manual_seed(0)
    loader = _epoch()
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    records = loaders.mid_epoch()
    assert len(records) == 1 and records[0]["fingerprint"][0] == "Tensor"
    after = torch.rand(3)  # the training draws on (dropout)
    resumed_at = torch.get_rng_state()

    loaders.arm(records)  # a restored worker: the stream is where the snapshot left it
    again = iter(_epoch())  # a new loader object, as a restarted script makes
    assert all(torch.equal(a, b) for a, b in zip(first, [next(again) for _ in range(2)], strict=True))
    assert torch.equal(torch.get_rng_state(), resumed_at)  # the replay drew nothing from it
    fresh = iter(_epoch())  # the next epoch: no record left, a draw of its own
    assert not torch.equal(torch.get_rng_state(), resumed_at)
    assert after.shape == (3,) and next(fresh).shape == (4,)


def test_a_loader_with_its_own_generator_replays_its_shuffle_and_ends_where_it_did() -> None:
    # The shuffle and the workers' seed come from the loader's generator, not the global RNG. A
    # restarted script seeds its generator afresh (or restores extra's copy, taken after the
    # epoch's draws): either way the restored iterator must draw what the interrupted one drew.
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(torch.arange(32.0), batch_size=4, shuffle=True, generator=gen)
    for _ in loader:  # a first epoch moves the generator on
        pass
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    after_draws = gen.get_state()
    records = loaders.mid_epoch()
    assert len(records) == 1 and "generator" in records[0]

    loaders.arm(records)
    fresh = torch.Generator().manual_seed(7)  # the restarted script's own, at the script's start
    again = iter(DataLoader(torch.arange(32.0), batch_size=4, shuffle=True, generator=fresh))
    assert all(torch.equal(a, b) for a, b in zip(first, [next(again) for _ in range(2)], strict=True))
    assert torch.equal(fresh.get_state(), after_draws)  # as in the run before the fault


def test_a_loader_with_its_own_generator_restored_at_an_epoch_end_shuffles_the_next_epoch_anew() -> None:
    """Acceptance 26B F2: restored right after an epoch, a loader whose generator is not in the
    State shuffled the next epoch as the first (the generator was back at its seed)."""
    gen = torch.Generator().manual_seed(7)
    loader = DataLoader(torch.arange(32.0), batch_size=4, shuffle=True, generator=gen)
    for _ in loader:  # the epoch the snapshot comes after
        pass
    records = loaders.mid_epoch()
    assert len(records) == 1 and "generator" in records[0]
    second = list(loader)  # the uninterrupted run's next epoch

    loaders.arm(records)
    fresh = torch.Generator().manual_seed(7)  # the restarted script's own, at the script's start
    again = list(DataLoader(torch.arange(32.0), batch_size=4, shuffle=True, generator=fresh))
    assert all(torch.equal(a, b) for a, b in zip(second, again, strict=True))
    assert torch.equal(fresh.get_state(), gen.get_state())


def test_exhausted_or_unstarted_iterators_are_not_recorded() -> None:
    loader = _epoch()
    assert loaders.mid_epoch() == []
    list(loader)  # a whole epoch: the next one starts from the restored stream
    assert loaders.mid_epoch() == []
    it = iter(loader)
    assert loaders.mid_epoch() == []  # made, nothing yielded yet
    next(it)
    assert len(loaders.mid_epoch()) == 1


def test_a_record_only_replays_for_a_loader_of_the_same_fingerprint() -> None:
    torch.manual_seed(1)
    it = iter(_epoch())
    next(it)
    loaders.arm(loaders.mid_epoch())
    other = DataLoader(torch.arange(8.0), batch_size=2, shuffle=True)
    before = torch.get_rng_state()
    iter(other)
    assert not torch.equal(torch.get_rng_state(), before)  # not replayed: its own draw
    assert len(loaders._armed) == 1
    loaders.arm("garbage")  # a malformed snapshot field arms nothing
    assert loaders._armed == []


def test_an_iterable_dataset_is_never_asked_its_length_and_odd_iterators_still_iterate() -> None:
    from torch.utils.data import IterableDataset

    class Stream(IterableDataset[int]):
        asked = 0

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(5))

        def __len__(self) -> int:
            Stream.asked += 1
            return 2  # an estimate: asking it would make torch warn as more items come

    got = []
    for item in DataLoader(Stream(), batch_size=None):  # not list(): that asks for a length hint
        got.append(int(item))
    assert got == [0, 1, 2, 3, 4] and Stream.asked == 0

    class Listed(DataLoader[int]):  # a subclass whose iterator takes no weak reference
        def _get_iterator(self):  # type: ignore[no-untyped-def]
            return iter([1, 2])

    assert list(Listed(range(2))) == [1, 2]


def test_a_restored_record_not_replayed_yet_goes_into_the_next_snapshot_once() -> None:
    torch.manual_seed(2)
    it = iter(_epoch())
    next(it)
    records = loaders.mid_epoch()
    del it
    loaders._latest.clear()  # a restored worker: nothing iterated yet

    loaders.arm(records)
    assert loaders.mid_epoch() == records  # a commit before the loader's first iterator
    loaders.arm(loaders.mid_epoch())  # restored again from that snapshot
    again = iter(_epoch())
    next(again)
    after = loaders.mid_epoch()
    assert len(after) == 1 and torch.equal(after[0]["rng"], records[0]["rng"])  # replayed, not doubled


def test_a_persistent_loader_restored_after_its_first_epoch_is_said_not_bit_exact(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Its worker processes are new after a restore and draw from their seed again, where the
    interrupted ones had drawn through every earlier epoch (random transforms): said at the
    restore, never silently, by rank 0 only (31A F5: every rank said it). Restored in its first
    epoch it is exact, and nothing is said."""
    monkeypatch.setenv("RANK", "0")
    torch.manual_seed(3)
    loader = _epoch(persistent=True, workers=1)
    for _ in range(3):  # epochs 1 and 2 done, epoch 3 begun
        it = iter(loader)
    next(it)
    records = loaders.mid_epoch()
    assert [r["epochs"] for r in records] == [3]
    del it, loader
    loaders._latest.clear()

    loaders.arm(records)
    resumed = _epoch(persistent=True, workers=1)
    next(iter(resumed))
    err = capsys.readouterr().err
    assert "persistent_workers was restored in its epoch 3" in err and "persistent_workers=False" in err
    assert [r["epochs"] for r in loaders.mid_epoch()] == [3]  # the count goes on from the interrupted run

    loaders._latest.clear()
    monkeypatch.setenv("RANK", "1")
    loaders.arm(records)
    next(iter(_epoch(persistent=True, workers=1)))
    assert "persistent_workers" not in capsys.readouterr().err, "rank 0 says it for the job"
    monkeypatch.setenv("RANK", "0")

    loaders._latest.clear()
    loaders.arm([dict(records[0], epochs=1)])
    next(iter(_epoch(persistent=True, workers=1)))
    assert "persistent_workers" not in capsys.readouterr().err
