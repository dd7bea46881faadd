"""A rank waiting on slow storage (an ``fsync`` of a checkpoint) is working, not hung.

The wait moves no counter the activity evidence reads (the bytes were counted when written to
the page cache) and uses no CPU: the process sits in uninterruptible sleep (state D) while the
disk drains. Slow storage is made for real: a cgroup v1 ``blkio`` write throttle on the device
under the test's directory, which the writing process joins itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e import read_events, remove_cgroup, run_unicron

from unicron.agent.usage import thread_states, tree_usage
from unicron.detect.activity import Activity, BusyRule, Usage, level_between

BLKIO = Path("/sys/fs/cgroup/blkio")
THROTTLE_BPS = 8 * 1024 * 1024  # 8 MB/s: 24 MB take 3 s to reach the disk


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[Path]:
    """A blkio cgroup throttling writes to the device under ``tmp_path``; yields its
    ``cgroup.procs`` (a process writes its own pid there to join it)."""
    dev = os.stat(tmp_path).st_dev
    if os.geteuid() != 0 or not (BLKIO / "blkio.throttle.write_bps_device").exists():
        pytest.skip("needs root and a cgroup v1 blkio controller to make slow storage")
    if os.major(dev) == 0:
        pytest.skip(f"{tmp_path} is on no block device (tmpfs): nothing to throttle")
    group = BLKIO / f"unicron-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        try:
            (group / "blkio.throttle.write_bps_device").write_text(f"{os.major(dev)}:{os.minor(dev)} {THROTTLE_BPS}")
        except OSError as err:
            pytest.skip(f"cannot throttle {os.major(dev)}:{os.minor(dev)} here: {err}")
        yield group / "cgroup.procs"
    finally:
        remove_cgroup(group)


def test_storage_wait_of_a_whole_window_is_work_and_of_one_end_only_is_not() -> None:
    rule = BusyRule()
    waiting = level_between(Usage(0.0, 1.0, 0, storage_wait=True), Usage(1.0, 1.0, 0, storage_wait=True), rule)
    assert waiting is Activity.WORKING
    # A page read at one sample's moment is no evidence of a long wait.
    assert level_between(Usage(0.0, 1.0, 0), Usage(1.0, 1.0, 0, storage_wait=True), rule) is Activity.IDLE
    assert level_between(Usage(0.0, 1.0, 0, storage_wait=True), Usage(1.0, 1.0, 0), rule) is Activity.IDLE


def test_an_fsync_to_a_slow_disk_is_seen_as_a_storage_wait_a_sleep_is_not(tmp_path: Path, throttled: Path) -> None:
    code = (f"import os, time\n"
            f"open({str(throttled)!r}, 'w').write(str(os.getpid()))\n"
            f"print('ready', flush=True)\n"
            f"with open({str(tmp_path / 'ckpt')!r}, 'wb') as f:\n"
            f"    f.write(os.urandom(24 << 20)); f.flush(); os.fsync(f.fileno())\n"
            f"print('synced', flush=True)\n")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                               stdout=subprocess.PIPE, text=True)
    writer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline().strip() == "ready"
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        seen = False
        deadline = time.monotonic() + 20
        while not seen and writer.poll() is None and time.monotonic() < deadline:
            seen = thread_states(writer.pid).storage_wait
            usage = tree_usage(writer.pid)
            seen = seen and usage is not None and usage.storage_wait
            time.sleep(0.05)
        assert seen, "the fsync of 24 MB at 8 MB/s was never seen waiting on storage"
        assert not thread_states(sleeper.pid).storage_wait
        usage = tree_usage(sleeper.pid)
        assert usage is not None and not usage.storage_wait
    finally:
        for proc in (sleeper, writer):
            proc.kill()
            proc.wait()


def test_a_checkpoint_fsynced_to_slow_storage_between_steps_is_no_hang(tmp_path: Path, throttled: Path) -> None:
    # Rank 0 writes and fsyncs a checkpoint (torch.distributed.checkpoint's sync_files, most
    # "atomic checkpoint" helpers) that takes ~3 s to reach the throttled disk, twice; rank 1
    # waits in a barrier meanwhile. The idle threshold here is 1.5 s.
    (tmp_path / "ckpt.py").write_text(f"""
import os, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if rank == 0:
    open({str(throttled)!r}, "w").write(str(os.getpid()))
for step in range(1, 31):
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.02)
    if rank == 0 and step in (12, 24):
        started = time.time()
        with open("ckpt.bin", "wb") as f:
            f.write(os.urandom(24 << 20))
            f.flush()
            os.fsync(f.fileno())
        print(f"checkpoint at step {{step}} synced in {{time.time() - started:.1f}} s", flush=True)
    dist.barrier()
print(f"rank {{rank}} done", flush=True)
""")
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"),
                                  str(tmp_path / "ckpt.py")], tmp_path, timeout=100)
    assert code == 0, err
    synced = [float(line.split(" synced in ")[1].split()[0]) for line in out.splitlines() if " synced in " in line]
    assert len(synced) == 2 and max(synced) > 1.5, out  # longer than the idle threshold: a real test
    faults = [e for e in read_events(tmp_path / "logs") if e["kind"] == "fault"]
    assert not faults, faults
