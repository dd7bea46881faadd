"""The snapshot format: JSON codec round trips, shared-memory slots, the marker protocol."""

from __future__ import annotations

import collections
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from unicron.agent.shm import scan_snapshots
from unicron.worker import snapcodec, snapshot, snapslots
from unicron.worker.state import State


def _same(a: Any, b: Any, path: str = "") -> None:
    """Equal values *and* exactly the same Python types, nan and -0.0 included; tensors bit for bit."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        if a.is_contiguous() or snapcodec._dense_permuted(a):
            assert a.stride() == b.stride(), path
        bits_a, bits_b = (t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b))
        assert torch.equal(bits_a, bits_b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
        for k in a:
            _same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b), path
    else:
        assert a == b, path


def _round_trip(tmp_path: Path, tree: Any) -> Any:
    """Through real files: encode, copy into a slot, JSON marker on disk, read back."""
    store = snapslots.SlotStore(tmp_path / "rank0", keep=2)
    store.prepare(newest_kept=0)
    encoder = snapcodec.Encoder()
    encoded = encoder.encode(tree, "tree")
    json.dumps(encoded, allow_nan=False)  # strict JSON: no NaN/Infinity literals
    store.write(1, encoded, encoder)
    return snapslots.read(store.directory, 1)


def _trained_optimizers() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    adam = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.99), amsgrad=True)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.OneCycleLR(adam, max_lr=0.1, total_steps=10)
    for _ in range(2):
        for opt in (adam, sgd):
            opt.zero_grad()
            model(torch.randn(5, 3)).pow(2).mean().backward()
            opt.step()
        sched.step()
    return {"model": model.state_dict(), "adam": adam.state_dict(), "sgd": sgd.state_dict(),
            "sched": sched.state_dict()}


def test_tricky_state_dicts_round_trip_with_their_types(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tree = {
        **_trained_optimizers(),
        "scaler": {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000,
                   "_growth_tracker": 0},
        "floats": [math.inf, -math.inf, math.nan, -0.0, 1e-310, 0.1, 2.0**60],
        "ints": [2**80, -1, 0, True, False, None],
        "keys": {1: "int", (2, "a"): "tuple", None: "none", 1.5: "float", False: "bool", "__x": "reserved"},
        "odd": (complex(1, -math.inf), b"\x00\xff", bytearray(b"ab"), {3, "s"}, torch.float16,
                torch.device("cpu"), torch.Size([2, 3]), collections.Counter("aab"), ()),
        "tagged_looking": {"__tensor__": 0, "__tuple__": [1]},  # user keys that look like tags
        "tensors": {
            "bf16": torch.randn(3, 5).to(torch.bfloat16), "fp16": torch.randn(7).half(),
            "bool": torch.tensor([True, False, True]), "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "i64": torch.tensor([2**62, -(2**62)]), "c64": torch.randn(2, dtype=torch.complex64),
            "f64_nan": torch.tensor([math.nan, -0.0, math.inf]),
            "scalar": torch.tensor(3.5), "scalar_int": torch.tensor(7), "empty": torch.empty(0, 3),
            "transposed": base.t(), "permuted": torch.randn(2, 3, 4).permute(2, 0, 1),
            "sliced": base[:, ::2], "expanded": torch.randn(3, 1).expand(3, 4), "row": base[1],
            "needs_grad": torch.nn.Parameter(torch.ones(2)),
        },
    }
    back = _round_trip(tmp_path, tree)
    tree["tensors"]["needs_grad"] = tree["tensors"]["needs_grad"].detach()  # comes back a plain tensor
    for name in ("sliced", "expanded", "row"):  # gaps or overlaps: values kept, strides contiguous
        assert back["tensors"][name].is_contiguous()
    _same(tree, back)
    assert back["tensors"]["transposed"].stride() == (1, 6)
    assert type(back["adam"]["param_groups"][0]["betas"]) is tuple  # OneCycleLR cycles betas[0]
    assert all(type(k) is int for k in back["adam"]["state"])


def test_restored_optimizers_continue_identically(tmp_path: Path) -> None:
    saved = _trained_optimizers()
    back = _round_trip(tmp_path, saved)
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    adam = torch.optim.AdamW(model.parameters(), lr=0.5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.OneCycleLR(adam, max_lr=0.1, total_steps=10)
    model.load_state_dict(back["model"])
    adam.load_state_dict(back["adam"])
    sgd.load_state_dict(back["sgd"])
    sched.load_state_dict(back["sched"])
    _same(saved["adam"], adam.state_dict())
    _same(saved["sgd"], sgd.state_dict())
    _same(saved["sched"], sched.state_dict())
    _same(saved["model"], model.state_dict())


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("make, where", [
    (lambda: {"x": [object()]}, r"tree\['x'\]\[0\] of type object"),
    (lambda: {"k": {object(): 1}}, r"key <object object"),
    (lambda: {"s": torch.eye(2).to_sparse()}, r"tree\['s'\].*layout torch.sparse_coo"),
    (lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)}, r"tree\['q'\].*qint8"),
    (lambda: {"e": collections.defaultdict(int)}, r"tree\['e'\] of type defaultdict"),
])
def test_unrepresentable_values_are_refused_with_their_path(make: Any, where: str) -> None:
    with pytest.raises(TypeError, match=where):
        snapcodec.Encoder().encode(make(), "tree")


def test_choose_slot_fills_free_slots_then_evicts_the_oldest() -> None:
    assert snapslots.choose_slot({}, range(3), 1) == 0
    assert snapslots.choose_slot({0: 5, 2: 7}, range(3), 8) == 1
    assert snapslots.choose_slot({0: 5, 1: 9, 2: 7}, range(3), 10) == 0
    assert snapslots.choose_slot({0: 12, 1: 9, 2: 10}, range(3), 13) == 1
    assert snapslots.choose_slot({0: 12, 1: 9, 2: 10}, range(3), 10) == 2  # the same step again: its own slot


def _markers(directory: Path) -> dict[int, int]:
    """step -> slot of every complete snapshot on disk."""
    return {s: snapslots.read_marker(directory / snapshot.snapshot_name(s))["slot"]
            for s in snapshot.list_steps(directory)}


def test_no_marker_points_at_a_slot_while_it_is_overwritten(tmp_path: Path, monkeypatch) -> None:
    store = snapslots.SlotStore(tmp_path / "rank0", keep=3)
    store.prepare(newest_kept=0)
    real_views = snapslots.SlotStore._slot_views
    overwritten: list[int] = []

    def checked_views(self: snapslots.SlotStore, slot: int, layout: Any) -> Any:  # taken to copy into
        assert slot not in _markers(self.directory).values(), (slot, _markers(self.directory))
        overwritten.append(slot)
        return real_views(self, slot, layout)

    monkeypatch.setattr(snapslots.SlotStore, "_slot_views", checked_views)
    rng = random.Random(1)
    steps = [3, 6, 9, 12, 13, 13, 14, 20, 21, 22, 30]  # sparse, repeated (with step % keep collisions)
    for step in steps:
        encoder = snapcodec.Encoder()
        tree = encoder.encode({"w": torch.full((rng.choice([10, 10, 300]),), float(step))}, "t")
        store.write(step, tree, encoder)
        on_disk = _markers(store.directory)
        assert sorted(on_disk) == sorted(set(steps[: steps.index(step) + 1]))[-3:]  # the newest three
        assert len(set(on_disk.values())) == len(on_disk)  # one slot per marker
        for s in on_disk:  # every complete snapshot still holds its own data
            assert torch.equal(snapslots.read(store.directory, s)["w"][:1], torch.tensor([float(s)]))
    assert set(overwritten) == {0, 1, 2}
    assert sorted(os.listdir(store.directory)) == ["slot0.bin", "slot1.bin", "slot2.bin",
                                                   "step0000000021.pt", "step0000000022.pt",
                                                   "step0000000030.pt"]


def test_layout_change_resizes_only_the_slot_being_written(tmp_path: Path) -> None:
    store = snapslots.SlotStore(tmp_path / "rank0", keep=2)
    store.prepare(newest_kept=0)
    sizes = {1: 100, 2: 5000, 3: 7, 4: 0}
    for step, n in sizes.items():
        encoder = snapcodec.Encoder()
        tree = encoder.encode({"a": torch.arange(n, dtype=torch.int32), "n": n, "h": torch.ones(3).half()}, "t")
        nbytes = store.write(step, tree, encoder)
        assert nbytes == snapcodec.align(4 * n) + 6
        assert os.path.getsize(store.directory / snapslots.slot_name((step - 1) % 2)) == nbytes
        prev = snapslots.read(store.directory, step - 1) if step > 1 else None
        if prev is not None:  # the other slot kept the older layout intact
            assert torch.equal(prev["a"], torch.arange(sizes[step - 1], dtype=torch.int32))
        assert torch.equal(snapslots.read(store.directory, step)["a"], torch.arange(n, dtype=torch.int32))


def test_failed_write_leaves_no_marker_on_the_slot_and_training_goes_on(
        tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("UNICRON_SNAPSHOT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("UNICRON_RESTORE_STEP", raising=False)
    monkeypatch.delenv("UNICRON_AGENT_ADDR", raising=False)
    weights = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(64))})
    state = State(model=weights, keep=2)
    for step in (1, 2):
        state.commit(step)
    assert state.flush(30)
    real_copy = snapslots._copy

    def dying_copy(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")  # what a full /dev/shm gives at fallocate

    monkeypatch.setattr(snapslots, "_copy", dying_copy)
    state.commit(3)  # slot of step 1 was being rewritten: its marker is gone, step 2 intact
    assert "snapshot write failed: OSError" in capsys.readouterr().err
    assert list(_markers(tmp_path / "rank0")) == [2] and state.step == 3
    monkeypatch.setattr(snapslots, "_copy", real_copy)
    state.commit(4)
    assert state.flush(30)
    assert list(_markers(tmp_path / "rank0")) == [2, 4]


def test_restart_drops_the_failed_attempts_later_steps(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("UNICRON_SNAPSHOT_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("UNICRON_AGENT_ADDR", raising=False)
    monkeypatch.delenv("UNICRON_RESTORE_STEP", raising=False)
    weights = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(8))})
    state = State(model=weights)
    for step in range(1, 6):
        with torch.no_grad():
            weights["w"].fill_(step)
        state.commit(step)
    assert state.flush(30)
    rank_dir = tmp_path / "rank0"
    (rank_dir / "step0000000006.pt.tmp").write_text("{")  # a marker being written when killed
    assert _markers(rank_dir) == {3: 2, 4: 0, 5: 1}

    monkeypatch.setenv("UNICRON_RESTORE_STEP", "4")
    weights2 = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(8))})
    state2 = State(model=weights2)
    assert state2.restore() == 4 and torch.equal(weights2["w"], torch.full((8,), 4.0))
    assert _markers(rank_dir) == {3: 2, 4: 0}  # step 5 belonged to the attempt that failed
    assert not list(rank_dir.glob("*.tmp"))
    state2.commit(5)
    state2.commit(6)  # evicts step 3, never step 4's slot before a newer one exists
    assert state2.flush(30)
    assert _markers(rank_dir) == {4: 0, 5: 1, 6: 2}

    monkeypatch.delenv("UNICRON_RESTORE_STEP")  # a fresh start drops every old snapshot
    state3 = State(model=weights2)
    assert state3.restore() == 0 and _markers(rank_dir) == {}


def test_agent_reports_data_bytes_of_each_step(tmp_path: Path) -> None:
    for rank, n in ((0, 1000), (1, 3000)):
        store = snapslots.SlotStore(tmp_path / f"rank{rank}", keep=3)
        store.prepare(newest_kept=0)
        for step in (1, 2):
            encoder = snapcodec.Encoder()
            store.write(step, encoder.encode({"a": torch.zeros(n)}, "t"), encoder)
    found, sizes = scan_snapshots(str(tmp_path))
    markers = {s: sum(os.path.getsize(tmp_path / f"rank{r}" / snapshot.snapshot_name(s)) for r in (0, 1))
               for s in (1, 2)}
    assert found == {"0": [1, 2], "1": [1, 2]}
    assert sizes == {str(s): 4000 + 12000 + markers[s] for s in (1, 2)}


def test_memoized_module_metadata_is_reused_only_while_equal(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    memo: dict[Any, Any] = {}
    first = snapcodec.Encoder(memo).encode(model.state_dict(), "model")
    again = snapcodec.Encoder(memo).encode(model.state_dict(), "model")
    assert again["meta"] is first["meta"]  # equal metadata: the previous encoding, not a new walk
    model[1]._version = 7  # what a module's version bump looks like in its state_dict
    changed = snapcodec.Encoder(memo).encode(model.state_dict(), "model")
    assert changed["meta"] is not first["meta"]
    restored = _round_trip(tmp_path, model.state_dict())
    assert restored._metadata["1"]["version"] == 7
    _same(restored, model.state_dict())
    # equal but not the same: True == 1 == 1.0, yet each must come back as what it was
    for version in (True, 1.0, 1):
        meta = collections.OrderedDict([("", {"version": version})])
        sd = collections.OrderedDict([("w", torch.zeros(1))])
        sd._metadata = meta  # type: ignore[attr-defined]
        again = snapcodec.decode(snapcodec.Encoder(memo).encode(sd, "m"), lambda i: torch.zeros(1))
        assert type(again._metadata[""]["version"]) is type(version)
    # keys: plain string keys go as JSON object keys, anything else as a tagged map, memo or not;
    # a str subclass equals its str, and is still refused after the plain key was seen
    class Key(str):
        pass

    for _ in range(2):
        with pytest.raises(TypeError, match="key"):
            snapcodec.Encoder(memo).encode({Key("a"): 1, "b": 2}, "x")
        assert snapcodec.Encoder(memo).encode({"a": 1, "b": 2}, "x") == {"a": 1, "b": 2}
        assert "__map__" in snapcodec.Encoder(memo).encode({1: "a", 2: "b"}, "x")
        assert "__map__" in snapcodec.Encoder(memo).encode({"__x": 1}, "x")


def test_a_snapshot_directory_removed_under_the_job_is_made_again(tmp_path: Path) -> None:
    """A cleanup script or another job's epilog removes the agent's directory in /dev/shm while
    the job runs: the next commit makes it again, private, and snapshots go on (they used to
    fail at every step from then on, and a restart went back to the script's start)."""
    store = snapslots.SlotStore(tmp_path / "shm" / "rank0", keep=3)
    store.prepare(newest_kept=0)
    tensor = torch.zeros(1000)

    def commit(step: int) -> None:
        tensor.fill_(step)
        encoder = snapcodec.Encoder()
        store.write(step, encoder.encode({"t": tensor}, "state"), encoder)

    commit(1)
    commit(2)
    import shutil

    shutil.rmtree(tmp_path / "shm")
    commit(3)
    assert store.notice is not None and "was removed while the job ran" in store.notice
    assert "steps 1-2 are gone" in store.notice
    assert store.held_steps == [3] and snapshot.list_steps(store.directory) == [3]
    assert torch.equal(snapslots.read(store.directory, 3)["t"], torch.full_like(tensor, 3))
    assert os.stat(tmp_path / "shm").st_mode & 0o777 == 0o700
    commit(4)
    assert store.held_steps == [3, 4]
