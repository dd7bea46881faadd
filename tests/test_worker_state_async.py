"""unicron.State's background half: commit() returns before the copy of parameters and optimizer
state is done, and nothing can change them before it is (the optimizer step pre-hook waits).
The background half is the default for GPU state; these tests ask for it with CPU tensors.

The background copy is slowed down on purpose (a gate the test opens), so every race a missing
fence would lose is lost for certain, not by chance."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers_worker import snapshot_env

from unicron.worker import snapshot, snapslots, snapwriter
from unicron.worker.state import State


@pytest.fixture()
def snap_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    snapshot_env(monkeypatch, tmp_path / "snaps", rank=0)
    return tmp_path / "snaps" / "rank0"


class Gate:
    """Holds every background finish until opened; records which thread ran it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.threads: list[str] = []
        real = snapslots.PendingSnapshot.finish

        def gated(pending: snapslots.PendingSnapshot) -> None:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.open.wait(30), "gate never opened"
            real(pending)

        monkeypatch.setattr(snapslots.PendingSnapshot, "finish", gated)


def _model_and_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.randn(6, 4)).pow(2).mean().backward()
    opt.step()


def _clone(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def test_commit_returns_before_the_copy_and_the_next_optimizer_step_waits_for_it(
        snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt, background=True)
    state.restore()
    _step(model, opt)
    committed = _clone(model.state_dict())
    committed_exp_avg = opt.state[model[0].weight]["exp_avg"].clone()
    gate = Gate(monkeypatch)
    state.commit(1)
    assert gate.entered.wait(30)
    assert snapshot.list_steps(snap_env) == []  # not complete yet: commit() did not wait for it

    stepped = threading.Event()

    def next_step() -> None:  # the training loop's next iteration, on its own thread here
        _step(model, opt)
        stepped.set()

    loop = threading.Thread(target=next_step)
    loop.start()
    assert not stepped.wait(0.5)  # the forward ran; optimizer.step() waits at the fence
    assert torch.equal(model[0].weight, committed["0.weight"])
    gate.open.set()
    loop.join(30)
    assert stepped.is_set() and not torch.equal(model[0].weight, committed["0.weight"])
    assert gate.threads == ["unicron-snapshot"]

    saved = snapslots.read(snap_env, 1)
    for k, v in committed.items():
        assert torch.equal(saved["objects"]["model"][k], v), k
    assert torch.equal(saved["objects"]["optimizer"]["state"][0]["exp_avg"], committed_exp_avg)


def test_what_the_next_forward_changes_is_copied_at_commit(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # BatchNorm running statistics change in every forward, extra tensors whenever the script
    # likes: only what optimizer.step() alone changes may be copied later.
    model, opt = _model_and_opt()
    extra = {"seen": torch.zeros(3)}
    state = State(model=model, optimizer=opt, extra=extra, background=True)
    state.restore()
    _step(model, opt)
    committed = _clone(model.state_dict())
    gate = Gate(monkeypatch)
    state.commit(1)
    assert gate.entered.wait(30)
    model(torch.randn(6, 4)).sum().backward()  # the next forward: running stats move
    extra["seen"] += 1
    assert not torch.equal(model[1].running_mean, committed["1.running_mean"])
    gate.open.set()
    assert state.flush(30)
    saved = snapslots.read(snap_env, 1)
    for k, v in committed.items():
        assert torch.equal(saved["objects"]["model"][k], v), k
    assert torch.equal(saved["extra"]["seen"], torch.zeros(3))


def test_a_failed_background_copy_is_reported_by_the_next_commit(
        snap_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt, background=True)
    state.restore()
    _step(model, opt)
    state.commit(1)
    assert state.flush(30)  # step 1 complete before the copy breaks
    real = snapslots._copy

    def failing(views: Any, tensors: Any, streams: Any = None) -> None:
        if streams is not None:  # the background half only
            raise RuntimeError("device-to-host copy failed")
        real(views, tensors)

    monkeypatch.setattr(snapslots, "_copy", failing)
    _step(model, opt)
    state.commit(2)
    assert state.flush(30) is True  # done (failed), reported here
    assert "snapshot write failed: RuntimeError: device-to-host copy failed" in capsys.readouterr().err
    assert snapshot.list_steps(snap_env) == [1] and state.step == 2
    monkeypatch.setattr(snapslots, "_copy", real)
    _step(model, opt)
    state.commit(3)
    assert state.flush(30) and snapshot.list_steps(snap_env) == [1, 3]


def test_flush_times_out_while_the_copy_is_held(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt, background=True)
    state.restore()
    gate = Gate(monkeypatch)
    state.commit(1)
    assert gate.entered.wait(30)
    assert state.flush(0.05) is False
    gate.open.set()
    assert state.flush(30) is True and snapshot.list_steps(snap_env) == [1]


_EXITING_WORKER = r"""
import os, sys, threading, torch
from unicron.worker import hooks, snapslots
from unicron.worker.state import State
real = snapslots.PendingSnapshot.finish
def slow(pending):  # still copying when the script ends
    threading.Event().wait(0.3)
    real(pending)
snapslots.PendingSnapshot.finish = slow
hooks.install()
model = torch.nn.Linear(3, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = State(model=model, optimizer=opt, background=True)
state.restore()
model(torch.ones(1, 3)).sum().backward()
opt.step()
state.commit(7)
if sys.argv[1] == "os_exit":
    os._exit(0)
"""


@pytest.mark.parametrize("how", ["return", "os_exit"])
def test_an_exiting_worker_finishes_its_snapshot_first(snap_env: Path, tmp_path: Path, how: str) -> None:
    env = {**os.environ, "UNICRON_SNAPSHOT_DIR": str(snap_env.parent), "RANK": "0"}
    env.pop("UNICRON_AGENT_ADDR", None)
    env.pop("UNICRON_STACK_DIR", None)
    env.pop("UNICRON_INJECT", None)
    script = tmp_path / "worker.py"
    script.write_text(_EXITING_WORKER)
    done = subprocess.run([sys.executable, str(script), how], env=env, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert snapshot.list_steps(snap_env) == [7]
    assert "weight" in snapslots.read(snap_env, 7)["objects"]["model"]


def test_fence_in_a_forked_child_does_not_wait_for_the_parents_writer() -> None:
    writer = snapwriter.Writer()
    release = threading.Event()
    writer.submit(lambda: release.wait(30) and None)
    assert writer.busy
    pid = os.fork()
    if pid == 0:  # the child: no writer thread came with the fork
        try:
            snapwriter.fence()
            os._exit(0 if writer.wait(0) else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 30
    status = None
    while status is None and time.monotonic() < deadline:  # a child stuck in the fence: fail, not hang
        done, raw = os.waitpid(pid, os.WNOHANG)
        status = raw if done else None
        if status is None:
            time.sleep(0.01)
    if status is None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    release.set()
    assert writer.wait(30)
    assert status is not None and os.waitstatus_to_exitcode(status) == 0


def test_cpu_state_commits_synchronously_by_default(snap_env: Path) -> None:
    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt)
    state.restore()
    for step in (1, 2):
        _step(model, opt)
        committed = _clone(model.state_dict())
        state.commit(step)
        assert snapshot.list_steps(snap_env)[-1] == step  # complete on return: no window
        assert not state._writer.busy
        saved = snapslots.read(snap_env, step)
        assert all(torch.equal(saved["objects"]["model"][k], v) for k, v in committed.items())


def test_background_with_nothing_to_defer_commits_at_once(snap_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = torch.nn.ParameterDict({"w": torch.nn.Parameter(torch.ones(8))})  # no optimizer in the State
    state = State(model=weights, background=True)
    state.restore()
    gate = Gate(monkeypatch)
    gate.open.set()
    state.commit(1)
    assert snapshot.list_steps(snap_env) == [1] and gate.threads == ["MainThread"]


def test_a_dropped_state_is_not_kept_alive_by_its_writer(snap_env: Path) -> None:
    import gc
    import weakref

    model, opt = _model_and_opt()
    state = State(model=model, optimizer=opt, background=True)
    state.restore()
    _step(model, opt)
    state.commit(1)
    assert state.flush(30)
    ref = weakref.ref(state)
    del state
    gc.collect()
    assert ref() is None
