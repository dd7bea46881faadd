"""Warm starts: a zygote with torch imported forks workers indistinguishable from cold ones."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers_worker import (
    BOOT,
    IMPORT_S,
    Rendezvous,
    agent_socket,
    base_env,
    broken_torch_env,
    wait_until,
    write_script,
)

from unicron.agent.logs import RankLogs
from unicron.agent.procs import WorkerProcess, start_worker
from unicron.agent.tee import ConsoleTee
from unicron.agent.terminate import terminate_all
from unicron.agent.warm import WarmPool
from unicron.agent.warmspec import (
    boot_argv,
    import_env_mismatch,
    is_import_time,
    shadowed_preloads,
    should_refill,
)
from unicron.worker.zygote import SpecError, parse_spec

PY = sys.executable

PROBE = """
    import faulthandler, json, os, signal, sys, tempfile
    print("first line of user code")
    import torch

    report = {
        "argv": sys.argv, "orig_argv": sys.orig_argv[1:], "path0": sys.path[0], "name": __name__,
        "main_file": sys.modules["__main__"].__file__, "cwd": os.getcwd(), "env": dict(os.environ),
        "threads": torch.get_num_threads(), "tempdir": tempfile.gettempdir(),
        "session_leader": os.getsid(0) == os.getpid(), "ppid": os.getppid(),
        "sigint": repr(signal.getsignal(signal.SIGINT)), "sigterm": repr(signal.getsignal(signal.SIGTERM)),
        "faulthandler": faulthandler.is_enabled(),
        # Open files (zmq's socket to the agent connects in the background: left out).
        "fds": sorted((fd, link) for fd, link in ((int(fd), os.readlink(f"/proc/self/fd/{fd}"))
                      for fd in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{fd}"))
                      if not link.startswith("socket:")),
    }
    print("REPORT " + json.dumps(report, sort_keys=True))
    print("a line on stderr", file=sys.stderr)
    if sys.argv[1] == "raise":
        raise ValueError("boom on rank " + os.environ["RANK"])
    sys.exit(int(sys.argv[1]))
"""

ALLREDUCE = """
    import os, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}")
    dist.destroy_process_group()
"""


def rank_logs(directory: Path, rank: int = 0) -> RankLogs:
    directory.mkdir(parents=True, exist_ok=True)
    return RankLogs(local_rank=rank, rank=rank, directory=str(directory),
                    stdout_path=str(directory / "stdout.log"), stderr_path=str(directory / "stderr.log"),
                    tee_stdout=False, tee_stderr=False, error_file=str(directory / "error.json"), prefix="")


@pytest.fixture
def started() -> Iterator[list[WorkerProcess]]:
    """Workers a test started (warm or cold); all are killed and reaped, even on failure."""
    procs: list[WorkerProcess] = []
    yield procs
    terminate_all(procs, 0.0, sig=signal.SIGKILL)


def finish(worker: WorkerProcess, timeout_s: float = IMPORT_S) -> int:
    code = worker.popen.wait(timeout_s)
    worker.poll()
    return code


def gone(pid: int) -> bool:
    """No such process: dead *and* reaped (a zombie would mean nobody waited for it)."""
    return not psutil.pid_exists(pid)


def outcome(worker: WorkerProcess, logs: RankLogs) -> dict[str, Any]:
    code = finish(worker)
    lines = Path(logs.stdout_path or "").read_text().splitlines(keepends=True)
    report = json.loads(next(x for x in lines if x.startswith("REPORT "))[len("REPORT "):])
    error = json.loads(Path(logs.error_file or "").read_text()) if os.path.exists(logs.error_file or "") else None
    if error is not None:
        del error["message"]["extraInfo"]["timestamp"]
    return {"code": code, "stdout": "".join(x for x in lines if not x.startswith("REPORT ")), "report": report,
            "stderr": Path(logs.stderr_path or "").read_text(), "error": error}


# ---- pure parts -------------------------------------------------------------------------


def test_boot_argv_accepts_only_the_pools_boot_command() -> None:
    assert boot_argv([PY, "-u", "-m", "unicron.worker.boot", "train.py", "--lr", "1"], PY) == ["train.py", "--lr", "1"]
    assert boot_argv([PY, "-u", "-m", "unicron.worker.boot", "--module", "pkg.train"], PY) == ["--module", "pkg.train"]
    assert boot_argv(["/other/python", "-u", "-m", "unicron.worker.boot", "t.py"], PY) is None
    assert boot_argv([PY, "-u", "t.py"], PY) is None
    assert boot_argv([PY, "-u", "-m", "unicron.worker.boot"], PY) is None


def test_import_time_variables_must_match() -> None:
    zygote = {"PYTHONPATH": "/a", "HOME": "/h", "OMP_NUM_THREADS": "8", "PATH": "/bin"}
    same = {**zygote, "RANK": "1", "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": "/e",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "CUDA_VISIBLE_DEVICES": "3", "PATH": "/usr/bin"}
    assert import_env_mismatch(zygote, same) == []
    assert import_env_mismatch(zygote, {**same, "PYTHONHASHSEED": "0", "TORCH_LOGS": "+dynamo"}) == [
        "PYTHONHASHSEED", "TORCH_LOGS"]
    assert import_env_mismatch(zygote, {k: v for k, v in same.items() if k != "HOME"}) == ["HOME"]
    assert is_import_time("LD_PRELOAD") and is_import_time("MKL_NUM_THREADS") and not is_import_time("NCCL_DEBUG")


def test_refill_waits_for_the_attempt_to_get_going() -> None:
    assert not should_refill(100.0, 95.0, 0, delay_s=30.0)  # workers still starting
    assert should_refill(100.0, 95.0, 1, delay_s=30.0)  # a step completed
    assert should_refill(125.0, 95.0, 0, delay_s=30.0)  # no steps reported, but time is up


def test_spec_is_checked() -> None:
    good = {"argv": ["t.py"], "env": {"A": "1"}, "cwd": "/", "stdout": None, "stderr": "/tmp/e"}
    assert parse_spec(json.dumps(good).encode()) == good
    for bad in (b"not json", b"[]", json.dumps({**good, "argv": "t.py"}).encode(),
                json.dumps({**good, "env": {"A": 1}}).encode(), json.dumps({**good, "stdout": 3}).encode()):
        with pytest.raises(SpecError):
            parse_spec(bad)


# ---- real processes ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["raise", "3"])
def test_warm_worker_is_indistinguishable_from_cold(tmp_path: Path, mode: str, subreaper: None,
                                                    started: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "probe.py", PROBE)
    cmd = [*BOOT, str(script), mode]
    with agent_socket() as agent, WarmPool(1, python=PY, base_env=base_env(), inherit_env=False) as pool:
        assert pool.refill() == 1
        assert pool.wait_ready(IMPORT_S)
        assert pool.threads == 1  # forks from a single-threaded process
        zygote = psutil.Process(pool.pids()[0])
        idle_cpu = sum(zygote.cpu_times()[:2])
        env = base_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2", UNICRON_AGENT_ADDR=agent.addr,
                       UNICRON_AGENT_PID=str(os.getpid()))
        logs = rank_logs(tmp_path / "logs" / "1", rank=1)
        cold = start_worker(cmd, env, logs, cwd=str(tmp_path), inherit_env=False)
        started.append(cold)
        cold_seen = outcome(cold, logs)
        cold_msgs = [(m["t"], m["rank"], m.get("pid")) for m in agent.drain(1.0)]
        # An idle zygote sleeps in read(): the seconds the cold worker ran cost it nothing.
        idle_cpu = sum(zygote.cpu_times()[:2]) - idle_cpu
        agent.messages.clear()

        warm = pool.take(cmd, env, logs, cwd=str(tmp_path), inherit_env=False)
        assert warm is not None, pool.last_miss
        started.append(warm)
        # A fresh fork, re-parented to us, leading its own session; the zygote stays for the next one.
        assert warm.pid != zygote.pid and os.getpgid(warm.pid) == warm.pid
        warm_seen = outcome(warm, logs)
        warm_msgs = [(m["t"], m["rank"], m.get("pid")) for m in agent.drain(1.0)]
        assert pool.idle() == 1 and pool.pids() == [zygote.pid] and pool.taken == 1

    for key in ("report", "stdout", "stderr", "error", "code"):
        if isinstance(cold_seen[key], dict):
            diff = {k: (cold_seen[key].get(k), warm_seen[key].get(k)) for k in {*cold_seen[key], *warm_seen[key]}
                    if cold_seen[key].get(k) != warm_seen[key].get(k)}
            assert not diff, f"{key} differs (cold, warm): {diff}"
    assert warm_seen == cold_seen
    assert cold_seen["code"] == (1 if mode == "raise" else 3)
    report = cold_seen["report"]
    assert report["argv"] == [str(script), mode] and report["name"] == "__main__"
    assert report["orig_argv"] == ["-u", "-m", "unicron.worker.boot", str(script), mode]
    assert report["env"]["TORCHELASTIC_ERROR_FILE"] == logs.error_file and report["threads"] == 1
    assert report["ppid"] == os.getpid() and report["session_leader"]  # the warm one's too (compared above)
    assert cold_seen["stdout"].startswith("first line of user code\n")
    assert cold_seen["stderr"].startswith("a line on stderr\n")
    if mode == "raise":
        assert "ValueError: boom on rank 1" in cold_seen["stderr"]
        assert cold_seen["error"]["message"]["message"] == "ValueError: boom on rank 1"
    else:
        assert cold_seen["error"] is None
    # The hooks ran in both: hello (and exc) from the worker's own pid.
    assert [m[:2] for m in warm_msgs] == [m[:2] for m in cold_msgs] and warm_msgs[0] == ("hello", 1, warm.pid)
    assert idle_cpu < 0.05, f"an idle zygote used {idle_cpu:.3f}s of CPU"


SEEDS = """
    import random, sys
    preloaded = "unicron.worker.state" in sys.modules
    import numpy, torch
    print(torch.initial_seed(), numpy.random.randint(2**62), random.getrandbits(64), preloaded)
"""


def test_forked_workers_draw_their_own_default_seeds(tmp_path: Path, subreaper: None,
                                                     started: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "seeds.py", SEEDS)
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        pool.refill()
        assert pool.wait_ready(IMPORT_S)
        plans = [rank_logs(tmp_path / "logs" / str(rank), rank) for rank in range(3)]
        workers = [pool.take([*BOOT, str(script)], base_env(RANK=str(rank)), plan, cwd=str(tmp_path))
                   for rank, plan in enumerate(plans)]
        assert all(workers), pool.last_miss
        started.extend(w for w in workers if w is not None)
        assert [finish(w) for w in workers if w is not None] == [0, 0, 0]
    seeds = [Path(plan.stdout_path or "").read_text().split() for plan in plans]
    # unicron's worker API came with the fork: the zygote's version of all of it (an upgrade
    # under a running job never mixes its old modules with new ones read from disk)
    assert [line.pop() for line in seeds] == ["True"] * 3
    for column in zip(*seeds, strict=True):  # torch, numpy, random: no two workers alike
        assert len(set(column)) == 3, seeds


KNOBS = """
    import os
    os.environ["OMP_NUM_THREADS"] = "2"
    os.environ["TORCH_LOGS"] = "+dynamo"
    os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"
    import logging
    import torch
    import torch._inductor.config

    print(torch.get_num_threads(), logging.getLogger("torch._dynamo").getEffectiveLevel(),
          torch._inductor.config.max_autotune)
"""


def test_variables_a_script_sets_before_import_torch_are_applied_or_named(
        tmp_path: Path, subreaper: None, started: list[WorkerProcess]) -> None:
    """Under torchrun a script's own os.environ settings above ``import torch`` take effect; a
    warm worker has torch imported already (acceptance pass 14: OMP_NUM_THREADS, TORCH_LOGS and
    inductor's settings were silently lost). The thread count and torch's logging are applied
    again; what torch cannot take again is named, with --no-warm."""
    script = write_script(tmp_path, "knobs.py", KNOBS)
    cold_logs, warm_logs = rank_logs(tmp_path / "cold"), rank_logs(tmp_path / "warm")
    cold = start_worker([*BOOT, str(script)], base_env(), cold_logs, cwd=str(tmp_path))
    started.append(cold)
    assert finish(cold) == 0
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        pool.refill()
        assert pool.wait_ready(IMPORT_S)
        warm = pool.take([*BOOT, str(script)], base_env(), warm_logs, cwd=str(tmp_path))
        assert warm is not None, pool.last_miss
        started.append(warm)
        assert finish(warm) == 0
    threads, level, autotune = Path(cold_logs.stdout_path or "").read_text().split()
    assert (threads, level, autotune) == ("2", "10", "True")  # torch's own reading, cold
    assert Path(warm_logs.stdout_path or "").read_text().split() == [threads, level, "False"]
    said = Path(warm_logs.stderr_path or "").read_text()
    assert "the script set TORCHINDUCTOR_MAX_AUTOTUNE before `import torch`" in said and "--no-warm" in said, said
    assert "OMP_NUM_THREADS" not in said and "TORCH_LOGS" not in said


def test_warm_gloo_job_and_console_output(tmp_path: Path, capfd: pytest.CaptureFixture[str], subreaper: None,
                                          started: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "allreduce.py", ALLREDUCE)
    rdzv = Rendezvous(2)
    console = io.BytesIO()
    tee = ConsoleTee(stdout=console)
    with WarmPool(2, python=PY, base_env=base_env()) as pool:
        pool.refill()
        teed = replace(rank_logs(tmp_path / "logs" / "0", 0), tee_stdout=True, prefix="[r0]:")
        logs = [teed, RankLogs(1, 1, None, None, None, False, False, None, "")]
        assert pool.wait_ready(IMPORT_S)
        workers = []
        for rank, plan in enumerate(logs):
            worker = pool.take([*BOOT, str(script)], base_env(**rdzv.rank_env(rank)), plan, tee=tee,
                               cwd=str(tmp_path))
            assert worker is not None, pool.last_miss
            started.append(worker)
            workers.append(worker)
        assert pool.idle() == 1 and pool.taken >= 2
        assert [finish(w) for w in workers] == [0, 0]
    tee.close()
    assert Path(logs[0].stdout_path or "").read_text() == "rank 0 of 2 sum 3\n"
    assert console.getvalue() == b"[r0]:rank 0 of 2 sum 3\n"  # followed like a cold worker's file
    assert capfd.readouterr().out == "rank 1 of 2 sum 3\n"  # stdout None: the console the agent had


def test_take_while_importing_is_a_miss_and_close_leaves_no_process(tmp_path: Path, subreaper: None,
                                                                   started: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "wait.py", "import time\ntime.sleep(600)\n")
    pool = WarmPool(2, python=PY, base_env=base_env())
    try:
        assert pool.refill() == 1
        assert pool.take([*BOOT, str(script)], base_env(), rank_logs(tmp_path / "a")) is None
        assert pool.last_miss == "zygote still importing" and not pool.settled()
        assert pool.wait_ready(IMPORT_S) and pool.settled()
        assert pool.refill() == 0  # running already
        (zygote,) = pool.pids()
        worker = pool.take([*BOOT, str(script)], base_env(), rank_logs(tmp_path / "b"), cwd=str(tmp_path))
        assert worker is not None, pool.last_miss
        started.append(worker)
    finally:
        pool.close()
    assert gone(zygote), "the zygote survived close()"
    assert worker.poll() is None  # what it forked is ours, and lives on
    assert pool.refill() == 0 and pool.idle() == 0
    assert pool.take([*BOOT, "t.py"], base_env(), rank_logs(tmp_path)) is None and pool.last_miss == "pool closed"
    terminate_all([worker], 0.0, sig=signal.SIGKILL)
    assert worker.returncode == -signal.SIGKILL and gone(worker.pid)


def test_not_a_subreaper_means_cold_starts(tmp_path: Path) -> None:
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        assert pool.refill() == 0 and pool.pids() == []
        assert pool.disabled is not None and "subreaper" in pool.disabled and pool.settled()
        assert pool.take([*BOOT, "t.py"], base_env(), rank_logs(tmp_path)) is None


def test_zygote_killed_while_idle_is_noticed(tmp_path: Path, subreaper: None) -> None:
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        pool.refill()
        assert pool.wait_ready(IMPORT_S)
        (pid,) = pool.pids()
        os.kill(pid, signal.SIGKILL)
        # Dead means waitable: a zombie leader whose other threads are gone.
        wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                   and len(os.listdir(f"/proc/{pid}/task")) <= 1, 10, "the zygote to die")
        logs = rank_logs(tmp_path)
        assert pool.take([*BOOT, "t.py"], base_env(), logs) is None
        assert pool.last_miss == "no live zygote" and pool.disabled is None
        assert gone(pid)  # reaped by the pool
        assert pool.refill() == 1 and pool.pids() != [pid]  # a replacement


def test_zygote_that_cannot_import_disables_the_pool(tmp_path: Path, subreaper: None) -> None:
    env = broken_torch_env(tmp_path)
    with WarmPool(1, python=PY, base_env=env) as pool:
        pool.refill()
        assert not pool.wait_ready(IMPORT_S)  # it died instead
        assert pool.take([*BOOT, "t.py"], env, rank_logs(tmp_path)) is None
        assert pool.disabled is not None and "code 3" in pool.disabled
        assert pool.refill() == 0  # no more zygotes that die at once


def test_take_refuses_what_would_not_be_a_cold_start(tmp_path: Path, subreaper: None) -> None:
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        pool.refill()
        logs = rank_logs(tmp_path)
        assert pool.take([PY, "-u", "t.py"], base_env(), logs) is None
        assert pool.last_miss == "not a boot command of the pool's python"
        assert pool.take([*BOOT, "t.py"], base_env(PYTHONHASHSEED="7"), logs) is None
        assert pool.last_miss == "import-time environment differs: PYTHONHASHSEED"
        assert pool.take([*BOOT, "t.py"], base_env(), logs, cwd=str(tmp_path / "missing")) is None
        assert pool.last_miss == "working directory is gone"
        assert pool.idle() == 1 and pool.taken == 0  # the zygote is still there for the next worker


def test_a_script_directory_that_shadows_a_preloaded_package_starts_cold(tmp_path: Path) -> None:
    # A cold worker puts the script's directory first on sys.path: its numpy.py would be imported
    # instead of the numpy a zygote already holds.
    (tmp_path / "numpy.py").write_text("")
    (tmp_path / "torch").mkdir()
    other = tmp_path / "clean"
    other.mkdir()
    assert shadowed_preloads([str(tmp_path / "train.py"), "--x"], "/") == ["numpy", "torch"]
    assert shadowed_preloads(["train.py"], str(tmp_path)) == ["numpy", "torch"]  # relative to the cwd
    assert shadowed_preloads(["--module", "pkg.train"], str(tmp_path)) == ["numpy", "torch"]  # -m: the cwd
    assert shadowed_preloads([str(other / "train.py")], str(tmp_path)) == []
    assert shadowed_preloads(["--module", "pkg.train"], str(other)) == []


def test_take_refuses_a_shadowing_script_directory(tmp_path: Path, subreaper: None) -> None:
    (tmp_path / "numpy.py").write_text("")
    with WarmPool(1, python=PY, base_env=base_env()) as pool:
        pool.refill()
        assert pool.take([*BOOT, str(tmp_path / "t.py")], base_env(), rank_logs(tmp_path / "logs")) is None
        assert pool.last_miss == "the script's directory shadows preloaded numpy"
