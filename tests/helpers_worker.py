"""Shared helpers for the worker tests: an agent-side PULL socket, workers, a tiny launcher."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from unicron.worker.channel import bell_address

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BOOT = [PYTHON, "-u", "-m", "unicron.worker.boot"]
IMPORT_S = 90.0  # importing torch on two shared, busy cores


def base_env(**extra: str) -> dict[str, str]:
    """A clean worker environment: unicron importable, no unicron variables inherited."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UNICRON_", "TORCHELASTIC_"))}
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"  # two shared cores: keep torch from oversubscribing
    env.update(extra)
    return env


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


class AgentSocket:
    """The agent's end of the worker channel: a PULL socket bound to ipc in a short tmp dir."""

    def __init__(self) -> None:
        # ipc paths are limited to ~107 bytes: pytest's tmp_path can be longer.
        self.dir = tempfile.mkdtemp(prefix="uw", dir="/tmp")
        self.addr = f"ipc://{self.dir}/agent.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        # Tests often read only after the worker exited: buffer everything meanwhile.
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.bind(self.addr)
        # The doorbell urgent messages ring, bound as the agent binds it: with no one there the
        # worker's zmq would keep reconnecting, and its fds would come and go.
        self.bell = self.ctx.socket(zmq.PULL)
        self.bell.bind(bell_address(self.addr))
        self.messages: list[dict[str, Any]] = []

    def drain(self, timeout_s: float = 0.0) -> list[dict[str, Any]]:
        """Receive what is there (waiting up to timeout_s for the first); returns all so far."""
        if self.sock.poll(int(timeout_s * 1000)):
            while True:
                try:
                    self.messages.append(json.loads(self.sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return self.messages

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            msgs = self.drain(0.05)
            for msg in msgs[seen:]:
                if pred(msg):
                    return msg
            seen = len(msgs)
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching message within {timeout_s}s; {len(msgs)} got, last {msgs[-5:]}")

    def of(self, t: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["t"] == t and (rank is None or m["rank"] == rank)]

    def close(self) -> None:
        self.sock.close(linger=0)
        self.bell.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def agent_socket() -> Iterator[AgentSocket]:
    agent = AgentSocket()
    try:
        yield agent
    finally:
        agent.close()


class Workers:
    """Processes started by a test; every one is killed and reaped on exit, even on failure."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(
        self, args: list[str], env: dict[str, str], cwd: str | Path | None = None
    ) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            args,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def boot(
        self,
        script: str | Path,
        *args: str,
        env: dict[str, str],
        cwd: str | Path | None = None,
        module: bool = False,
    ) -> subprocess.Popen[str]:
        head = [*BOOT, "--module"] if module else BOOT
        return self.start([*head, str(script), *args], env, cwd)

    def close(self) -> None:
        for proc in self.procs:
            try:  # the whole session: also children such as dataloader workers
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if proc.stdout is not None and not proc.stdout.closed:
                # Output nobody read (a test failed midway): pytest shows it with the failure.
                out, err = proc.communicate(timeout=30)
                print(f"--- worker {proc.args[-3:]} pid {proc.pid} rc {proc.returncode}\n"
                      f"stdout: {out[-2000:]}\nstderr: {err[-4000:]}")
            proc.wait(timeout=30)


@contextmanager
def workers() -> Iterator[Workers]:
    group = Workers()
    try:
        yield group
    finally:
        group.close()


def finish(proc: subprocess.Popen[str], timeout_s: float = 60.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def run_boot(
    script: str | Path,
    *args: str,
    env: dict[str, str],
    cwd: str | Path | None = None,
    module: bool = False,
    timeout_s: float = 60.0,
) -> tuple[int, str, str]:
    with workers() as group:
        return finish(group.boot(script, *args, env=env, cwd=cwd, module=module), timeout_s)


def broken_torch_env(tmp_path: Path) -> dict[str, str]:
    """``base_env`` with a ``torch`` first on the path that fails to import (a zygote that cannot import)."""
    broken = tmp_path / "shadow"
    broken.mkdir()
    (broken / "torch.py").write_text("raise RuntimeError('this torch is broken')\n")
    env = base_env()
    env["PYTHONPATH"] = f"{broken}{os.pathsep}{env['PYTHONPATH']}"
    return env


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


class Rendezvous:
    """A TCPStore hosted by the test, one per attempt, as torchelastic's agent does."""

    def __init__(self, world_size: int) -> None:
        from torch.distributed import TCPStore

        self.world_size = world_size
        self.store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)

    def rank_env(self, rank: int, attempt: int = 0) -> dict[str, str]:
        return {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
        }


def snapshot_env(monkeypatch: pytest.MonkeyPatch, root: Path, rank: int) -> None:
    """This process as rank ``rank`` of a unicron worker with snapshots under ``root``: no
    agent, no restore step (a fresh start)."""
    monkeypatch.setenv("UNICRON_SNAPSHOT_DIR", str(root))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.delenv("UNICRON_RESTORE_STEP", raising=False)
    monkeypatch.delenv("UNICRON_AGENT_ADDR", raising=False)


def sleeping_group(tmp_path: Path, nproc: int, sleep_s: float = 120.0) -> tuple[Any, Any]:
    """A ``WorkerGroup`` of ``nproc`` ranks on one node that only sleep, not started yet, and the
    console tee it writes to (close it after ``group.stop``): the agent's bookkeeping, driven by
    hand-made channel messages, over real processes."""
    from unicron.agent.logs import LogSpec, RunLogDir
    from unicron.agent.ranks import GroupSpec
    from unicron.agent.tee import ConsoleTee
    from unicron.agent.workers import WorkerGroup
    from unicron.detect.hang import HangDetector

    spec = GroupSpec(attempt=0, restart_count=0, rank_offset=0, world_size=nproc, node_rank=0, nnodes=1,
                     local_world_sizes=(nproc,), master_addr="127.0.0.1", master_port=1, restore_step=None, inject="")
    tee = ConsoleTee()
    group = WorkerGroup(spec, cmd=[sys.executable, "-c", f"import time; time.sleep({sleep_s})"], env_for=lambda *_: {},
                        run_logs=RunLogDir(LogSpec(log_dir=str(tmp_path)), "j"), tee=tee, host="h",
                        hang=HangDetector(), role="default", stack_dir=str(tmp_path))
    return group, tee
