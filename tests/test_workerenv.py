"""The worker environment and command: torchrun's, value for value (unit tests), and real
workers that rendezvous through env:// against a store hosted the way the agent hosts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from unicron.errors import UsageError
from unicron.launch import LaunchConfig, master_addr_for, worker_command, worker_env
from unicron.launch.workerenv import AGENT_OWNED_VARS, TORCHRUN_WORKER_VARS

REPO_ROOT = Path(__file__).resolve().parents[1]


def env_for(cfg: LaunchConfig, base: dict[str, str] | None = None, *, local_rank: int = 1, rank: int = 3,
            **kw: object) -> dict[str, str]:
    args: dict = dict(local_rank=local_rank, rank=rank, world_size=4, local_world_size=2, group_rank=1,
                      group_world_size=2, role_rank=rank, role_world_size=4, master_addr="head", master_port=1234,
                      restart_count=2, run_id="job-1", error_file="/logs/job-1_x/attempt_2/1/error.json", extra={})
    args.update(kw)
    return worker_env(base if base is not None else {"PATH": "/bin"}, cfg=cfg, **args)


def test_torchrun_keys_and_values() -> None:
    cfg = LaunchConfig(script="t.py", nproc_per_node=2, max_restarts=3, role="trainer")
    env = env_for(cfg)
    assert env == {
        "PATH": "/bin",
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4", "ROLE_NAME": "trainer",
        "MASTER_ADDR": "head", "MASTER_PORT": "1234", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job-1", "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": "/logs/job-1_x/attempt_2/1/error.json",
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OMP_NUM_THREADS": "1",
    }
    assert set(TORCHRUN_WORKER_VARS) == set(env) - {"PATH"}


def test_omp_num_threads_rule() -> None:
    many, one = LaunchConfig(script="t", nproc_per_node=2), LaunchConfig(script="t", nproc_per_node=1)
    assert env_for(many)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in env_for(one, local_rank=0, rank=0, local_world_size=1)
    assert env_for(many, {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"  # the user's choice stands


def test_inherited_values_and_overrides() -> None:
    base = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "RANK": "99", "CUDA_VISIBLE_DEVICES": "2,3", "HOME": "/h",
            **{name: "stale" for name in AGENT_OWNED_VARS}}
    cfg = LaunchConfig(script="t", nproc_per_node=2, signals_to_handle=("SIGTERM", "SIGUSR1"))
    env = env_for(cfg, base, extra={"UNICRON_AGENT_ADDR": "ipc:///tmp/a", "UNICRON_INJECT": "kill@3:1"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["RANK"] == "3" and env["HOME"] == "/h"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"  # inherited untouched, as torchrun does
    assert env["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    assert env["UNICRON_AGENT_ADDR"] == "ipc:///tmp/a" and env["UNICRON_INJECT"] == "kill@3:1"
    for name in AGENT_OWNED_VARS:
        if name not in ("UNICRON_AGENT_ADDR", "UNICRON_INJECT"):
            assert name not in env  # never leaked from the launcher's environment
    assert env_for(cfg, error_file="")["TORCHELASTIC_ERROR_FILE"] == ""


def test_virtual_local_rank() -> None:
    cfg = LaunchConfig(script="t", nproc_per_node=2, virtual_local_rank=True)
    env = env_for(cfg, {"CUDA_VISIBLE_DEVICES": "4, 6"})
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "6"
    assert env_for(cfg, {})["CUDA_VISIBLE_DEVICES"] == "1"
    with pytest.raises(UsageError, match="local rank 1 has no GPU"):
        env_for(cfg, {"CUDA_VISIBLE_DEVICES": "4"})


def test_bad_placement_is_refused() -> None:
    with pytest.raises(ValueError):
        env_for(LaunchConfig(script="t"), local_rank=2)


def test_worker_commands() -> None:
    py = "/py"
    plain = LaunchConfig(script="t.py", script_args=("--a", "--"), python_exec=py)
    assert worker_command(plain, inject=False) == [py, "-u", "t.py", "--a", "--"]
    assert worker_command(plain, inject=True) == [py, "-u", "-m", "unicron.worker.boot", "t.py", "--a", "--"]
    module = LaunchConfig(script="pkg.m", script_args=("x",), module=True, python_exec=py)
    assert worker_command(module, inject=False) == [py, "-u", "-m", "pkg.m", "x"]
    assert worker_command(module, inject=True) == [py, "-u", "-m", "unicron.worker.boot", "--module", "pkg.m", "x"]
    raw = LaunchConfig(script="./run.sh", script_args=("-v",), no_python=True, python_exec=py)
    assert worker_command(raw, inject=True) == ["./run.sh", "-v"] == worker_command(raw, inject=False)
    off = LaunchConfig(script="t.py", no_inject=True, python_exec=py)
    assert worker_command(off, inject=True) == [py, "-u", "t.py"]
    run_path = LaunchConfig(script="/abs/t.py", script_args=("a",), run_path=True, no_python=True, python_exec=py)
    cmd = worker_command(run_path, inject=False)
    assert cmd[:3] == [py, "-u", "-c"] and cmd[-2:] == ["/abs/t.py", "a"]
    assert worker_command(run_path, inject=True) == [py, "-u", "-m", "unicron.worker.boot", "/abs/t.py", "a"]


def test_master_addr_like_torchrun() -> None:
    assert master_addr_for(LaunchConfig(script="t", rdzv_backend="static", rdzv_host="10.0.0.1"), fqdn="me") == "10.0.0.1"
    assert master_addr_for(LaunchConfig(script="t"), fqdn="node1.cluster") == "node1.cluster"
    assert master_addr_for(LaunchConfig(script="t", local_addr="10.9.9.9"), fqdn="x") == "10.9.9.9"


def test_run_path_and_plain_commands_see_the_same_argv(tmp_path: Path) -> None:
    script = tmp_path / "show.py"
    script.write_text("import json, sys\nprint(json.dumps({'argv': sys.argv, 'name': __name__}))\n")
    outs = []
    for flags in ({}, {"run_path": True}):
        cfg = LaunchConfig(script=str(script), script_args=("--x", "1", "--"), python_exec=sys.executable, **flags)
        done = subprocess.run(worker_command(cfg, inject=False), capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outs.append(json.loads(done.stdout))
    assert outs[0] == outs[1] == {"argv": [str(script), "--x", "1", "--"], "name": "__main__"}


WORKER = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
json.dump({"sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(),
           "elastic": dist.is_torchelastic_launched()}, open(sys.argv[1] + f"/out{os.environ['RANK']}.json", "w"))
dist.destroy_process_group()
"""


def test_real_workers_rendezvous_on_the_agent_store(tmp_path: Path) -> None:
    """Two workers with worker_env join a TCPStore hosted here, as the agent hosts it: env://
    with TORCHELASTIC_USE_AGENT_STORE=True connects as a client, and a fresh store per attempt
    works whatever TORCHELASTIC_RESTART_COUNT says."""
    from torch.distributed import TCPStore

    attempt = 1  # a restarted attempt: its fresh store must work whatever the count says
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    script = tmp_path / "w.py"
    script.write_text(WORKER)
    cfg = LaunchConfig(script=str(script), script_args=(str(tmp_path),), nproc_per_node=2, python_exec=sys.executable)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "UNICRON_"))}
    base["PYTHONPATH"] = str(REPO_ROOT)
    procs = []
    try:
        for local_rank in range(2):
            env = worker_env(base, cfg=cfg, local_rank=local_rank, rank=local_rank, world_size=2, local_world_size=2,
                             group_rank=0, group_world_size=1, role_rank=local_rank, role_world_size=2,
                             master_addr="127.0.0.1", master_port=store.port, restart_count=attempt, run_id="t",
                             error_file=str(tmp_path / f"err{local_rank}.json"), extra={})
            procs.append(subprocess.Popen(worker_command(cfg, inject=False), env=env, stderr=subprocess.PIPE))
        deadline = time.monotonic() + 90
        for proc in procs:
            _, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank in range(2):
        out = json.loads((tmp_path / f"out{rank}.json").read_text())
        assert out == {"sum": 3.0, "rank": rank, "world": 2, "elastic": True}
