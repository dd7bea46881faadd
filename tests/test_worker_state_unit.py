"""unicron.State in one process: snapshot layout, restore of every piece of state, refusals."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_worker import snapshot_env

import unicron
from unicron.errors import ConfigError
from unicron.worker import snapshot, snapslots
from unicron.worker.errors import SnapshotTypeError, StateError
from unicron.worker.state import State


def _model_and_opt(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(5, 3)
    loss = model(x).pow(2).mean() + random.random() + float(np.random.rand())
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture()
def snap_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    snapshot_env(monkeypatch, tmp_path / "snaps", rank=1)
    return tmp_path / "snaps"


def test_public_api_is_lazy() -> None:
    assert unicron.__version__ == "0.1.0" and unicron.State is State
    with pytest.raises(AttributeError):
        unicron.Nope  # noqa: B018


def test_commit_then_restore_continues_bit_for_bit(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    extra = {"seen": 0, "hist": [], "t": torch.zeros(2)}
    state = State(model=model, optimizer=opt, scheduler=sched, extra=extra)
    assert state.restore() == 0 and state.enabled
    for step in range(4):
        _train_step(model, opt)
        sched.step()
        extra["seen"] += 5
        extra["hist"].append(step)
        extra["t"] += 1
        state.commit(step + 1)
    assert state.flush(30) and state.step == 4
    # what the uninterrupted run does next
    _train_step(model, opt)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_draws = (torch.rand(3), random.random(), np.random.rand())

    assert snapshot.list_steps(snap_env / "rank1") == [2, 3, 4]  # newest three kept
    assert not list((snap_env / "rank1").glob("*.tmp"))

    monkeypatch.setenv("UNICRON_RESTORE_STEP", "4")
    model2, opt2 = _model_and_opt(seed=123)  # different init: restore must overwrite it
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    extra2: dict = {"seen": -1}
    state2 = State(model=model2, optimizer=opt2, scheduler=sched2, extra=extra2)
    random.seed(99)
    torch.manual_seed(99)
    assert state2.restore() == 4 and state2.step == 4
    assert extra2 is state2.extra and extra2["seen"] == 20 and extra2["hist"] == [0, 1, 2, 3]
    assert torch.equal(extra2["t"], torch.full((2,), 4.0))
    assert sched2.last_epoch == 4 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    _train_step(model2, opt2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected[k]), k
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]


def test_slots_reused_without_corrupting_earlier_snapshots(snap_env: Path) -> None:
    weight = torch.nn.Parameter(torch.zeros(1000))
    holder = torch.nn.ParameterDict({"w": weight})
    state = State(model=holder)
    ptrs = []
    for step in range(1, 8):
        with torch.no_grad():
            weight.fill_(float(step))
        state.commit(step)
        ptrs.append({k: m.data_ptr() for k, m in state._store._maps.items()})
    assert state.flush() and state.flush(0)  # nothing left in flight once flushed
    assert ptrs[2] == ptrs[6]  # three slots mapped once, no allocation or mapping per step
    rank_dir = snap_env / "rank1"
    assert sorted(os.listdir(rank_dir)) == ["slot0.bin", "slot1.bin", "slot2.bin",
                                            *(snapshot.snapshot_name(s) for s in (5, 6, 7))]
    for step in (5, 6, 7):
        saved = snapslots.read(rank_dir, step)
        assert torch.equal(saved["objects"]["model"]["w"], torch.full((1000,), float(step)))
    marker = json.loads((rank_dir / snapshot.snapshot_name(7)).read_text())  # plain JSON, no pickle
    assert marker["nbytes"] >= 4000 + 5056 and marker["slot"] == 0  # weights + torch RNG, 7 % 3 round robin


def test_outside_unicron_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("UNICRON_SNAPSHOT_DIR", "UNICRON_RESTORE_STEP", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt)
    assert state.restore() == 0 and not state.enabled
    state.commit(1)
    assert state.step == 1 and list(tmp_path.iterdir()) == []


def test_missing_snapshot_starts_fresh(snap_env: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "7")
    model, _ = _model_and_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert State(model=model).restore() == 0
    assert "no snapshot" in capsys.readouterr().err
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_refusals(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="state_dict"):
        State(model=object())
    # StateErrors, so the classifier stops the job rather than restart it into the same error.
    with pytest.raises(SnapshotTypeError, match=r"extra=\.\.\.\) must be a dict; got list"):
        State(extra=[1, 2])  # type: ignore[arg-type]
    for keep in (0, -1, True, 1.5):
        with pytest.raises(StateError, match="keep"):
            State(keep=keep)  # type: ignore[arg-type]
    model, _ = _model_and_opt()
    state = State(model=model, extra={"ok": [1, {"bad": np.float64(1.0)}]})
    with pytest.raises(TypeError, match=r"extra\['ok'\]\[1\]\['bad'\] of type float64"):
        state.commit(1)
    state = State(model=model)
    state.commit(2)
    state.flush()
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "2")
    model2, opt2 = _model_and_opt()
    with pytest.raises(ValueError, match="holds"):
        State(model=model2, optimizer=opt2).restore()
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "soon")
    with pytest.raises(ConfigError, match="UNICRON_RESTORE_STEP"):
        State(model=model2)


def test_partial_writes_of_a_killed_worker_are_cleaned(snap_env: Path) -> None:
    rank_dir = snap_env / "rank1"
    rank_dir.mkdir(parents=True)
    (rank_dir / "step0000000009.pt.tmp").write_bytes(b"half")
    model, _ = _model_and_opt()
    state = State(model=model)
    state.commit(10)
    state.flush()
    assert sorted(os.listdir(rank_dir)) == ["slot0.bin", "step0000000010.pt"]


def test_snapshot_layout_helpers(tmp_path: Path) -> None:
    assert snapshot.snapshot_path(tmp_path, 3, 12).name == "step0000000012.pt"
    for rank, steps in {0: [4, 5, 6], 1: [3, 4, 5], 2: [5]}.items():
        d = snapshot.rank_dir(tmp_path, rank)
        d.mkdir()
        for s in steps:
            (d / snapshot.snapshot_name(s)).write_bytes(b"x")
        (d / "step0000000099.pt.tmp").write_bytes(b"partial")  # incomplete: ignored
    found = snapshot.steps_by_rank(tmp_path)
    assert found == {0: [4, 5, 6], 1: [3, 4, 5], 2: [5]}
    assert snapshot.common_step(found, [0, 1]) == 5 and snapshot.common_step(found, [0, 1, 2]) == 5
    assert snapshot.common_step({0: [1, 2], 1: [3]}, [0, 1]) is None
    assert snapshot.common_step(found, [0, 7]) is None  # a rank with no snapshot at all
    assert snapshot.steps_to_prune([5, 1, 3, 4], keep=3) == [1]
    assert snapshot.steps_by_rank(tmp_path / "missing") == {}


def test_a_step_that_goes_back_is_refused_with_or_without_snapshots(snap_env: Path, monkeypatch) -> None:
    model, _ = _model_and_opt()
    state = State(model=model)
    state.commit(4)
    state.commit(4)  # the same step again replaces its snapshot
    with pytest.raises(unicron.StateError, match=r"commit\(1\) after step 4: the step must not go back"):
        state.commit(1)  # a per-epoch batch index: the agent would restore another epoch's step
    assert state.flush(30) and snapshot.list_steps(snap_env / "rank1") == [4]
    monkeypatch.delenv("UNICRON_SNAPSHOT_DIR")
    plain = State(model=model)  # under torchrun too: the script fails the same way everywhere
    plain.commit(3)
    with pytest.raises(ValueError, match="must not go back"):
        plain.commit(2)


def test_two_states_taking_turns_at_one_ranks_snapshots_are_refused(snap_env: Path) -> None:
    a = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4))})
    b = torch.nn.ParameterDict({"v": torch.nn.Parameter(torch.ones(4))})
    first, second = State(model=a), State(model2=b)
    assert first.restore() == 0 and second.restore() == 0
    with pytest.raises(unicron.StateError, match="two States take turns at rank 1's snapshots"):
        first.commit(1)
    second.commit(1)  # the one that took over goes on
    del second  # once the other is gone, the first may take the directory back
    first.commit(2)
    assert first.flush(30) and set(snapslots.read(snap_env / "rank1", 2)["objects"]) == {"model"}


def test_refusals_are_state_errors_the_classifier_stops_on(snap_env: Path, monkeypatch) -> None:
    state = State(model=torch.nn.Linear(2, 2), extra={"x": np.float64(1.0)})
    with pytest.raises(TypeError) as refused:
        state.commit(1)
    assert isinstance(refused.value, unicron.StateError) and str(refused.value).startswith("unicron.State")
    weights = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.zeros(4))})
    State(model=weights).commit(2)
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "2")
    with pytest.raises(unicron.StateError, match=r"^unicron.State: the snapshot of step 2 .* holds \['model'\]"):
        State(net=weights).restore()


def test_a_snapshot_that_no_longer_fits_the_model_is_a_state_error_naming_the_mismatch(
        snap_env: Path, monkeypatch) -> None:
    """The script changed between attempts (a layer widened): every restart would fail the same
    way in load_state_dict, so it is a StateError the job stops on, with torch's reason in one line."""
    State(model=torch.nn.Sequential(torch.nn.Linear(4, 8))).commit(3)
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "3")
    with pytest.raises(unicron.StateError) as refused:
        State(model=torch.nn.Sequential(torch.nn.Linear(4, 16))).restore()
    text = str(refused.value)
    assert text.startswith("unicron.State: the snapshot of step 3 does not fit 'model' as it is now")
    assert "size mismatch for 0.weight" in text and "\n" not in text


def test_a_zero_redundancy_optimizer_is_refused_with_its_inner_optimizer_named(tmp_path) -> None:
    # Its state_dict() consolidates every shard on one rank (a collective; an error elsewhere),
    # so every commit failed and the job restarted until its budget was spent.
    import subprocess
    import sys

    script = f"""
import torch, torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
import unicron
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
model = torch.nn.Linear(4, 2)
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
try:
    unicron.State(model=model, optimizer=zero)
except unicron.StateError as err:
    print("refused:", err)
state = unicron.State(model=model, optimizer=zero.optim)  # the rank-local shard: accepted
dist.destroy_process_group()
"""
    env = {**os.environ, "UNICRON_SNAPSHOT_DIR": str(tmp_path / "snaps"), "RANK": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110, env=env)
    assert out.returncode == 0, out.stderr
    assert "refused: unicron.State(optimizer=...): a ZeroRedundancyOptimizer's state_dict() is a collective" in out.stdout
    assert "unicron.State(optimizer=optimizer.optim, ...)" in out.stdout


def test_a_dtensor_shard_is_placed_as_its_live_counterpart_or_refused(tmp_path) -> None:
    """``worker/shards.py``: a shard takes the live DTensor's mesh and placements when both are
    shaped alike; another shape (a new mesh, a factored optimizer state) is a StateError, never
    a tensor placed as something it is not."""
    import subprocess
    import sys

    script = f"""
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from unicron.worker.errors import StateError
from unicron.worker.shards import place_shards
from unicron.worker.snapcodec import LocalShard
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
class Live:
    def state_dict(self):
        return {{"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "n": 3}}
placed = place_shards("model", {{"w": LocalShard(torch.ones(4, 2), torch.Size([4, 2])), "n": 3}}, Live())
assert isinstance(placed["w"], DTensor) and placed["w"].placements == (Shard(0),) and placed["n"] == 3
assert torch.equal(placed["w"].to_local(), torch.ones(4, 2))
try:
    place_shards("model", {{"w": LocalShard(torch.ones(4), torch.Size([4]))}}, Live())
except StateError as err:
    print("refused:", err)
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert "refused: unicron.State: model['w'] was a DTensor of shape (4,)" in out.stdout


def test_random_generators_the_script_owns_are_snapshotted_and_restored(snap_env: Path, monkeypatch) -> None:
    """A torch.Generator for sampling, numpy's default_rng for augmentation, a random.Random:
    no state_dict() of their own, passed by name they are restored with the rest, bit for bit."""
    gen, rng, py = torch.Generator().manual_seed(7), np.random.default_rng(7), random.Random(7)
    state = State(gen=gen, rng=rng, py=py)
    for step in range(3):
        torch.randn(4, generator=gen), rng.random(5), py.random()
        state.commit(step + 1)
    assert state.flush(30)
    expected = (torch.randn(4, generator=gen), rng.random(5), py.random(), py.gauss(0, 1))

    monkeypatch.setenv("UNICRON_RESTORE_STEP", "3")
    gen2, rng2, py2 = torch.Generator().manual_seed(99), np.random.default_rng(99), random.Random(99)
    assert State(gen=gen2, rng=rng2, py=py2).restore() == 3
    again = (torch.randn(4, generator=gen2), rng2.random(5), py2.random(), py2.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]
    # Any numpy bit generator (their states hold arrays) and the legacy RandomState too
    mt, sfc = np.random.Generator(np.random.MT19937(3)), np.random.Generator(np.random.SFC64(5))
    philox, legacy = np.random.Generator(np.random.Philox(7)), np.random.RandomState(11)
    state = State(mt=mt, sfc=sfc, philox=philox, legacy=legacy)
    mt.random(3), sfc.random(3), philox.random(3), legacy.rand(3)
    state.commit(4)
    assert state.flush(30)
    want = (mt.random(4), sfc.random(4), philox.random(4), legacy.rand(4))
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "4")
    mt2, sfc2 = np.random.Generator(np.random.MT19937(0)), np.random.Generator(np.random.SFC64(0))
    philox2, legacy2 = np.random.Generator(np.random.Philox(0)), np.random.RandomState(0)
    assert State(mt=mt2, sfc=sfc2, philox=philox2, legacy=legacy2).restore() == 4
    got = (mt2.random(4), sfc2.random(4), philox2.random(4), legacy2.rand(4))
    assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
    # What has no state to restore is refused at once, as a StateError (the job stops, never restarted)
    for odd in (object(), random.SystemRandom(), 3):
        with pytest.raises(unicron.StateError, match=r"^unicron.State\(odd=...\) needs an object with state_dict"):
            State(odd=odd)


def test_restore_puts_extra_into_the_scripts_own_objects(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A hand-written momentum kept in extra: the script updates its own dict of tensors every
    # step. After a restore it must hold the restored values, as its model does.
    mom = {"w": torch.zeros(3), "b": torch.zeros(1)}
    hist: list = []
    state = State(extra={"mom": mom, "hist": hist, "n": 0, "shape": torch.zeros(2), "losses": [], "tail": [7]})
    for step in range(1, 4):
        mom["w"].add_(step)
        hist.append(step)
        state.extra["losses"].append(step / 10)
        state.extra["n"] = step
        state.commit(step)
    state.flush()
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "3")
    mine = {"w": torch.zeros(3), "b": torch.zeros(1), "stale": torch.ones(1)}
    my_hist = [0, 0, 0]
    other_shape = torch.zeros(5)
    # A history the script starts empty (acceptance 19A F1: it kept its own empty list) and a
    # list longer than the one saved are restored in place too.
    my_losses: list = []
    my_tail = [1, 2, 3]
    again = State(extra={"mom": mine, "hist": my_hist, "n": -1, "shape": other_shape, "losses": my_losses,
                         "tail": my_tail})
    assert again.restore_step == 3
    assert again.restore() == 3
    assert again.extra["mom"] is mine and torch.equal(mine["w"], torch.full((3,), 6.0)) and "stale" not in mine
    assert again.extra["hist"] is my_hist and my_hist == [1, 2, 3] and again.extra["n"] == 3
    assert again.extra["shape"] is not other_shape and again.extra["shape"].shape == (2,)  # replaced, not forced
    assert again.extra["losses"] is my_losses and my_losses == [0.1, 0.2, 0.3]
    assert again.extra["tail"] is my_tail and my_tail == [7]


def test_restore_step_is_known_before_restore(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _model_and_opt()
    assert State(model=model).restore_step == 0  # not restarted
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "9")
    assert State(model=model).restore_step == 0  # offered, but this rank holds no such snapshot
    state = State(model=model)
    state.commit(9)
    state.flush()
    assert State(model=model).restore_step == 9


def test_a_random_generator_in_extra_is_refused_with_the_way_to_pass_it(snap_env: Path) -> None:
    state = State(extra={"g": random.Random(1)})
    with pytest.raises(SnapshotTypeError, match=r"extra\['g'\] of type Random: .*pass it to State by name, "
                                                r"State\(\.\.\., g=it\)"):
        state.commit(1)


def _restarting_at_step_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    """A model whose rank 0 committed step 3, and this process as its restarted worker told to
    restore step 3."""
    snapshot_env(monkeypatch, tmp_path / "snaps", rank=0)
    model, _ = _model_and_opt()
    first = State(model=model)
    first.restore()
    first.commit(3)
    first.flush()
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "3")
    return model


def test_a_restart_that_never_calls_restore_says_it_started_from_the_scripts_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The console said "restoring step S from memory": a script that commits but never calls
    restore() must be told it did not (rank 0 says it, once)."""
    model = _restarting_at_step_3(tmp_path, monkeypatch)
    restored = State(model=model)
    assert restored.restore() == 3
    restored.commit(4)
    assert "was not called" not in capsys.readouterr().err
    forgot = State(model=model)
    forgot.commit(1)
    forgot.commit(2)
    err = capsys.readouterr().err
    assert err.count("State.restore() was not called before commit(1): step 3 was in memory") == 1, err


def test_an_lr_scheduler_left_out_of_the_state_is_warned_of_once_at_the_first_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    snapshot_env(monkeypatch, tmp_path / "snaps", rank=0)
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    state = State(model=model, optimizer=opt)
    state.commit(1)
    state.commit(2)
    err = capsys.readouterr().err
    assert err.count("an LR scheduler of 'optimizer' is not in this unicron.State") == 1, err
    assert "optimizer=optimizer, scheduler=scheduler" in err
    State(model=model, optimizer=opt, scheduler=sched).commit(3)
    assert "LR scheduler" not in capsys.readouterr().err
    plain_model, plain_opt = _model_and_opt()
    State(model=plain_model, optimizer=plain_opt).commit(1)  # no scheduler was ever built
    assert "LR scheduler" not in capsys.readouterr().err


def test_an_attempt_that_restored_does_not_warn_again_of_what_is_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """31A F5: the warnings are once per job, and the attempt that started fresh said them."""
    snapshot_env(monkeypatch, tmp_path / "snaps", rank=0)
    model, opt = _model_and_opt()
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    first = State(model=model, optimizer=opt)
    first.restore()
    first.commit(3)
    first.flush()
    assert "LR scheduler" in capsys.readouterr().err
    monkeypatch.setenv("UNICRON_RESTORE_STEP", "3")
    restored = State(model=model, optimizer=opt)
    assert restored.restore() == 3
    restored.commit(4)
    assert "LR scheduler" not in capsys.readouterr().err
    monkeypatch.delenv("UNICRON_RESTORE_STEP")
    fresh = State(model=model, optimizer=opt)  # a fresh start (new world size) says it again
    fresh.restore()
    fresh.commit(1)
    assert "LR scheduler" in capsys.readouterr().err


def test_schedulers_left_out_sees_each_optimizer_and_wrapping_schedulers() -> None:
    from unicron.worker.leftout import schedulers_left_out
    model, first = _model_and_opt()
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    chained = torch.optim.lr_scheduler.SequentialLR(
        first, [torch.optim.lr_scheduler.ConstantLR(first), torch.optim.lr_scheduler.StepLR(first, 3)], milestones=[2])
    torch.optim.lr_scheduler.StepLR(second, 3)
    said = schedulers_left_out({"a": first, "b": second, "s": chained})
    assert len(said) == 1 and "of 'b'" in said[0], said
    assert len(schedulers_left_out({"a": first, "b": second})) == 2


def test_optimizers_left_out_are_the_ones_that_stepped_outside_the_state_and_its_wrappers() -> None:
    from unicron.worker.leftout import optimizers_left_out

    model, opt = _model_and_opt()
    _train_step(model, opt)  # Adam: it holds moments now
    head = torch.nn.Linear(3, 1)
    critic = torch.optim.Adam(head.parameters(), lr=0.1)
    head(torch.ones(2, 3)).sum().backward()
    critic.step()
    plain = torch.optim.SGD(head.parameters(), lr=0.1)  # no momentum: no state to lose
    plain.step()
    said = optimizers_left_out({"model": model, "optimizer": opt}, [opt, critic, plain])
    assert len(said) == 1 and "an optimizer (Adam) that has stepped is not in this unicron.State" in said[0], said
    assert optimizers_left_out({"model": model, "optimizer": opt, "critic": critic}, [opt, critic, plain]) == []

    class Wrapper:  # a ZeroRedundancyOptimizer's or a Lookahead's shape: the State holds the inner one
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optim, self.state = inner, {"x": 1}

    assert optimizers_left_out({"optimizer": opt, "critic": critic}, [Wrapper(critic)]) == []


def test_steps_that_are_not_whole_numbers_of_64_bits_are_state_errors(snap_env: Path, monkeypatch) -> None:
    """Acceptance 27C F2/F10: commit(10**20) broke the stop that followed any fault (the mesh
    carries 64-bit integers), and commit("x") or commit(nan) raised a plain ValueError that was
    restarted. Each is the script's mistake: a StateError, under torchrun too."""
    model, _ = _model_and_opt()
    for env in (True, False):
        if not env:
            monkeypatch.delenv("UNICRON_SNAPSHOT_DIR")
        state = State(model=model)
        for bad in (10**20, 2**63, -1, "3", float("nan"), 2.5, None, True, torch.tensor(1.5), np.bool_(True),
                    torch.tensor(True), torch.tensor([5]), np.array([5])):
            with pytest.raises(StateError, match=r"the step must be"):
                state.commit(bad)  # type: ignore[arg-type]
        state.commit(np.int64(2))
        state.commit(torch.tensor(3))
        state.commit(4.0)  # type: ignore[arg-type]
        state.commit(2**63 - 1)


def test_a_state_holding_itself_is_refused_as_a_snapshot_type_error(snap_env: Path) -> None:
    """27C F10: a self-referential extra raised RecursionError, which was restarted."""
    extra: dict = {"a": 1}
    extra["me"] = extra
    state = State(model=_model_and_opt()[0], extra=extra)
    with pytest.raises(SnapshotTypeError, match="hold themselves"):
        state.commit(1)


def test_restore_after_a_commit_is_refused_not_a_silent_fresh_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """27C F6: commit() then restore() in a restarted attempt let the announced snapshot go at
    the commit, and restore() then said "no snapshot; starting fresh": all progress redone."""
    model = _restarting_at_step_3(tmp_path, monkeypatch)
    late = State(model=model)
    late.commit(1)
    with pytest.raises(StateError, match=r"restore\(\) after commit\(1\): call restore\(\) before the first"):
        late.restore()


def test_a_commit_between_optimizer_steps_with_gradients_accumulated_is_warned_of_once(
        snap_env: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Acceptance 27A F2: a commit per micro-batch of a gradient accumulation: the snapshot has
    no .grad, so a restore from one mid-accumulation does not continue bit for bit, and nothing
    said so. 28A F4: steps the script skips (a GradScaler's on an inf, a bad batch) and
    evaluation-only iterations leave gradients at a commit too, which the next zero_grad()
    drops: not warned of; nor a loop that commits after each optimizer step."""
    monkeypatch.setenv("RANK", "0")
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt)
    state.restore()
    step = 0
    for i in range(9):  # commit once an iteration; some iterations skip the step or only evaluate
        opt.zero_grad()
        loss = model(torch.randn(5, 3)).pow(2).mean()
        if i % 3 != 2:  # every third iteration evaluates only
            loss.backward()
            if i != 4:  # a skipped step (an inf the scaler saw)
                opt.step()
        step += 1
        state.commit(step)
    state.commit(step)  # the same step again
    model.zero_grad(set_to_none=False)  # a module's zero_grad, in place, counts too
    assert "accumulated" not in capsys.readouterr().err
    for micro in range(8):  # accumulate 4 micro-batches a step, committing each
        model(torch.randn(5, 3)).pow(2).mean().backward()
        if micro % 4 == 3:
            opt.step()
            opt.zero_grad()
        step += 1
        state.commit(step)
    err = capsys.readouterr().err
    assert err.count(f"gradients were accumulated across State.commit({step - 7}) (no optimizer step since the "
                     "commit before it)") == 1, err
    assert err.count("accumulated") == 1, err


def test_keep_1_with_several_ranks_is_said_once_on_rank_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys) -> None:
    """Acceptance 33A F3: with one slot per rank, a kill between two ranks' commits of a step
    left rank 0 holding only step 5 and rank 1 only step 4: nothing restored, silently."""
    from unicron.worker.state import KEEP_ONE_WARNING

    snapshot_env(monkeypatch, tmp_path / "snaps", rank=0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    State(keep=1)
    assert capsys.readouterr().err.strip() == KEEP_ONE_WARNING
    State(keep=2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # said in the first attempt
    State(keep=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one rank: its one step is the job's
    State(keep=1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")  # every rank sees the same: rank 0 says it
    State(keep=1)
    assert capsys.readouterr().err == ""
