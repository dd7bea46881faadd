"""A worker killed by the kernel's OOM killer is diagnosed as such, not as "a SIGKILL from outside".

Real: the job runs in a memory cgroup of its own (cgroup v1 or v2, created and removed here)
under a limit, and rank 1 of the first attempt allocates until the kernel kills it. The agent sees
the exit through its pidfd within milliseconds; the OOM kill must already count then."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e import clean_env, read_events, remove_cgroup, unicron_cmd, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LIMIT = 3 << 30  # bytes for the whole job (launcher, zygote, two ranks); the hoarding rank goes past it

SCRIPT = """
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    hoard = []
    while True:
        hoard.append(b"\\x01" * (64 << 20))  # written, so resident: until the kernel kills this rank
for _ in range(3):
    dist.all_reduce(t)
dist.destroy_process_group()
print(f"rank {rank} done in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
"""


def _memory_cgroup() -> tuple[Path, str, list[str]] | None:
    """(directory, limit file, extra limit files) of a new memory cgroup, or None if none can be made."""
    name = f"unicron-test-{uuid.uuid4().hex[:8]}"
    v1 = Path("/sys/fs/cgroup/memory")
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            group = v1 / name
            group.mkdir()
            swap = ["memory.memsw.limit_in_bytes"] if (group / "memory.memsw.limit_in_bytes").exists() else []
            return group, "memory.limit_in_bytes", swap
        if "memory" in (v2 / "cgroup.subtree_control").read_text().split():
            group = v2 / name
            group.mkdir()
            return group, "memory.max", ["memory.swap.max"] if (group / "memory.swap.max").exists() else []
    except OSError:
        return None
    return None


@pytest.fixture
def cgroup() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a memory cgroup")
    made = _memory_cgroup()
    if made is None:
        pytest.skip("no memory cgroup can be made here")
    group, limit_file, swap_files = made
    try:
        (group / limit_file).write_text(str(LIMIT))
        for swap in swap_files:  # no swap to escape into: the limit is the limit
            (group / swap).write_text(str(LIMIT) if swap.startswith("memory.memsw") else "0")
        yield group
    finally:
        remove_cgroup(group)


def test_an_oom_killed_worker_is_named_as_such_and_the_job_heals(workdir: Path, cgroup: Path) -> None:
    (workdir / "hoard.py").write_text(SCRIPT)
    cmd = " ".join(unicron_cmd("run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2",
                               "--log-dir", str(workdir / "logs"), "hoard.py"))
    # The shell joins the cgroup first, so the launcher and everything it starts are in it.
    proc = subprocess.run(["sh", "-c", f"echo $$ > {cgroup}/cgroup.procs && exec {cmd}"], cwd=workdir,
                          env=clean_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 done in attempt 1" in proc.stdout and "rank 1 done in attempt 1" in proc.stdout, proc.stdout
    decisions = wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "decision"], 10,
                         "the decision event")
    assert decisions[0]["rule"] == "oom-killer", decisions[0]
    assert "killed by the kernel OOM killer" in proc.stderr, proc.stderr
