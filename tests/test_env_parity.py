"""Side by side with the real torchrun of the installed torch: every worker gets the same
environment, rank by rank, `is_torchelastic_launched()` is true and env:// rendezvous works.

Values that legitimately differ per run (MASTER_PORT, TORCHELASTIC_RUN_ID, the error-file path)
are checked for shape instead of equality.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from unicron.launch import parse_run_args
from unicron.launch.workerenv import master_addr_for, worker_env

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
PER_RUN = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE")
SCRIPT_ARGS = ["--lr", "0.1", "--", "-h", "--nnodes", "5"]

DUMP_ENV = r'''
import json, os, sys
import torch
import torch.distributed as dist
out_dir = sys.argv[1]
parent = json.load(open(os.path.join(out_dir, "..", "parent.json")))
# everything the launcher set or changed, relative to the environment it was started with
diff = {k: v for k, v in os.environ.items() if parent.get(k) != v and k != "_"}
launched = dist.is_torchelastic_launched()
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
result = {"env": diff, "removed": sorted(k for k in parent if k not in os.environ), "launched": launched,
          "sum": t.item(), "rank": dist.get_rank(), "world": dist.get_world_size(), "argv": sys.argv[2:]}
dist.destroy_process_group()
with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump(result, fh)
'''


def clean_env() -> dict[str, str]:
    """The launchers' environment: no inherited launcher variables, unicron importable."""
    drop = ("TORCHELASTIC_", "PET_", "UNICRON_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTHON_EXEC"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def launch(cmd: list[str], cwd: Path, env: dict[str, str], out_dir: Path, nproc: int) -> list[dict]:
    out_dir.mkdir()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:  # reap the launcher and everything it started
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, f"{cmd[0]} failed ({proc.returncode}):\n{output.decode()[-3000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


LAUNCH_FLAGS = {"standalone": ["--standalone", "--nproc-per-node", "2"], "default-rdzv": ["--nproc_per_node=2"]}


@pytest.fixture(scope="module", params=sorted(LAUNCH_FLAGS))
def torchrun_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One real torchrun run per flag set, shared by both tests: (flags, workdir, env, outputs)."""
    flags = LAUNCH_FLAGS[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    (tmp / "dump_env.py").write_text(DUMP_ENV)
    env = clean_env()
    (tmp / "parent.json").write_text(json.dumps(env))
    outs = launch([str(TORCHRUN), *flags, "dump_env.py", str(tmp / "torchrun"), *SCRIPT_ARGS], tmp, env,
                  tmp / "torchrun", 2)
    return flags, tmp, env, outs


def check_shapes(out: dict, local_rank: int, where: str) -> None:
    env = out["env"]
    assert env["MASTER_PORT"].isdigit() and 0 < int(env["MASTER_PORT"]) < 65536, where
    assert UUID.match(env["TORCHELASTIC_RUN_ID"]), where
    path = env["TORCHELASTIC_ERROR_FILE"]
    assert path.endswith(f"/attempt_0/{local_rank}/error.json") and env["TORCHELASTIC_RUN_ID"] in path, where
    assert out["launched"] and out["sum"] == 3.0 and out["world"] == 2 and out["argv"] == SCRIPT_ARGS, where


def test_torchrun_reference_matches_worker_env(torchrun_run) -> None:
    """The torchrun half: check that our pure worker_env, given the same per-run values,
    produces exactly what the real torchrun gave each worker."""
    flags, tmp, env, outs = torchrun_run
    cfg = parse_run_args([*flags, str(tmp / "dump_env.py")], env)
    for local_rank, out in enumerate(outs):
        check_shapes(out, local_rank, "torchrun")
        assert out["removed"] == []
        got = out["env"]
        expected = worker_env(env, cfg=cfg, local_rank=local_rank, rank=local_rank, world_size=2,
                              local_world_size=2, group_rank=0, group_world_size=1, role_rank=local_rank,
                              role_world_size=2, master_addr=master_addr_for(cfg, fqdn=socket.getfqdn()),
                              master_port=int(got["MASTER_PORT"]), restart_count=0,
                              run_id=got["TORCHELASTIC_RUN_ID"], error_file=got["TORCHELASTIC_ERROR_FILE"],
                              extra={})
        assert got == {k: v for k, v in expected.items() if env.get(k) != v}


def test_unicron_run_matches_torchrun(torchrun_run) -> None:
    flags, tmp, env, ref = torchrun_run
    ours = launch([sys.executable, "-m", "unicron", "run", *flags, "dump_env.py", str(tmp / "unicron"),
                   *SCRIPT_ARGS], tmp, env, tmp / "unicron", 2)
    for local_rank, (theirs, mine) in enumerate(zip(ref, ours, strict=True)):
        check_shapes(mine, local_rank, "unicron")
        mine_env = {k: v for k, v in mine["env"].items() if not k.startswith("UNICRON_")}
        assert sorted(mine_env) == sorted(theirs["env"]), f"rank {local_rank}: keys differ"
        for key, value in theirs["env"].items():
            if key not in PER_RUN:
                assert mine_env[key] == value, f"rank {local_rank}: {key}={mine_env[key]!r}, torchrun: {value!r}"
        assert mine["removed"] == theirs["removed"] == []
        assert {k: mine[k] for k in ("launched", "sum", "rank", "world", "argv")} == \
               {k: theirs[k] for k in ("launched", "sum", "rank", "world", "argv")}


SHOW_UNICRON_ENV = r'''
import json, os, sys
import torch.distributed as dist
import unicron
dist.init_process_group("gloo")
with open("/proc/self/environ", "rb") as fh:  # what a warm worker's process shows to the world
    proc_environ = fh.read()
seen = {"attempt": os.environ["TORCHELASTIC_RESTART_COUNT"], "secret_in_proc": b"s3cret-xyz" in proc_environ,
        "vars": {k: v for k, v in os.environ.items() if k.startswith("UNICRON_")}}
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.attempt{seen['attempt']}.json"), "w") as fh:
    json.dump(seen, fh)
for _ in range(5):
    dist.barrier()
    unicron.step()
dist.destroy_process_group()
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("warm", [True, False])
def test_the_launchers_own_unicron_variables_never_reach_a_worker(tmp_path: Path, warm: bool) -> None:
    # The job secret, and a fault given through the environment: it must fire on the first
    # attempt only, as --inject does, so the restarted attempt finishes.
    (tmp_path / "show.py").write_text(SHOW_UNICRON_ENV)
    env = {**clean_env(), "UNICRON_SECRET": "s3cret-xyz", "UNICRON_INJECT": "exit=3@1:2",
           "UNICRON_RESTORE_STEP": "5"}
    cmd = [sys.executable, "-m", "unicron", "run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           *([] if warm else ["--no-warm"]), "show.py", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    seen = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")}
    assert sorted(seen) == sorted(f"rank{r}.attempt{a}.json" for a in (0, 1) for r in (0, 1))
    for name, worker in seen.items():
        assert not worker["secret_in_proc"], name
        assert "UNICRON_SECRET" not in worker["vars"] and "UNICRON_RESTORE_STEP" not in worker["vars"], name
        assert worker["vars"].get("UNICRON_INJECT") == ("exit=3@1:2" if worker["attempt"] == "0" else None), name


READ_STDIN = r'''
import os, sys
line = sys.stdin.readline()  # what pdb and input() read: the launcher's stdin, as under torchrun
print(f"rank {os.environ['RANK']} read {line.strip()!r}", flush=True)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "unicron", "unicron --no-warm"])
def test_a_worker_reads_the_launchers_stdin(tmp_path: Path, launcher: str) -> None:
    (tmp_path / "read.py").write_text(READ_STDIN)
    cmd = ([str(TORCHRUN)] if launcher == "torchrun" else [sys.executable, "-m", "unicron", "run",
                                                           *launcher.split()[1:]])
    proc = subprocess.run([*cmd, "--standalone", "--nproc-per-node", "1", "read.py"], cwd=tmp_path,
                          env=clean_env(), input="hello from the terminal\n", capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 read 'hello from the terminal'" in proc.stdout
