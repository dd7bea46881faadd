"""Snapshot directories of agents that died without cleaning up are removed by the next agent."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil

from unicron.agent.shm import OWNER_FILE, newest_snapshot, remove_orphaned_shm
from unicron.worker.snapshot import snapshot_name


def _owned(base, name: str, pid: int, created: float) -> str:
    path = base / name
    (path / "rank0").mkdir(parents=True)
    (path / "rank0" / "slot0.bin").write_bytes(b"x" * 1024)
    (path / OWNER_FILE).write_text(f"{pid} {created}")
    return str(path)


def test_only_dead_owners_lose_their_directory(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(dead.pid).create_time()
    dead.wait()
    me = psutil.Process(os.getpid())
    gone = _owned(tmp_path, "unicron-job-dead", dead.pid, created)
    reused = _owned(tmp_path, "unicron-job-reused", os.getpid(), me.create_time() - 100)  # pid reused since
    mine = _owned(tmp_path, "unicron-job-mine", os.getpid(), me.create_time())
    foreign = tmp_path / "unicron-unmarked"
    foreign.mkdir()
    remove_orphaned_shm(str(tmp_path))
    assert not os.path.exists(gone) and not os.path.exists(reused)
    assert os.path.exists(mine) and foreign.exists()


def test_work_dirs_of_dead_agents_are_removed_by_the_next_one(monkeypatch) -> None:
    import tempfile
    from pathlib import Path

    # A short temp dir of its own: under a long one (pytest-xdist's) the work dir goes to /tmp.
    tmp_path = Path(tempfile.mkdtemp(prefix="uc-shm-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        _check_work_dirs(tmp_path)
    finally:
        import shutil

        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_work_dirs(tmp_path) -> None:
    from unicron.agent.shm import make_work_dir

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    created = psutil.Process(dead.pid).create_time()
    dead.wait()
    left = _owned(tmp_path, "unicron-agent-left", dead.pid, created)  # an agent that was SIGKILLed
    mine = make_work_dir()
    assert os.path.basename(mine).startswith("unicron-agent-") and os.path.dirname(mine) == str(tmp_path)
    assert not os.path.exists(left)
    second = make_work_dir()  # another live agent on this machine keeps its directory
    assert os.path.exists(mine) and os.path.exists(second)


def test_the_work_directory_leaves_a_temp_dir_too_long_for_its_sockets() -> None:
    from unicron.agent.shm import SOCKET_PATH_MAX, work_base

    short, long_ = "/scratch/job", "/scratch/" + "x" * 80
    assert work_base(short, lambda d: True) == short
    assert work_base(long_, lambda d: True) == "/tmp"
    assert work_base(long_, lambda d: d == "/dev/shm") == "/dev/shm"  # /tmp not writable here
    assert work_base(long_, lambda d: False) is None
    edge = "/" + "e" * (SOCKET_PATH_MAX - len("/unicron-agent-XXXXXXXX/agent.sock.bell") - 1)
    assert work_base(edge, lambda d: True) == edge and work_base(edge + "e", lambda d: True) == "/tmp"


HOLDER = ("import sys\n"
          "from unicron.agent.shm import make_owned_dir\n"
          "print(make_owned_dir('unicron-job-', sys.argv[1]), flush=True)\n"
          "sys.stdin.read()\n")


def test_a_live_agent_in_another_pid_namespace_keeps_its_directory(tmp_path) -> None:
    """Acceptance 19B F4: a container started with --ipc=host shares /dev/shm but not pids; a
    job starting there removed a running job's snapshots as orphaned (its owner's pid meant
    nothing in the new namespace). The owner's lock says it lives; once it is gone, the lock
    is free and its directory goes."""
    import shutil

    import pytest

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a PID namespace")
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        path = holder.stdout.readline().strip()
        if not path:
            pytest.skip(f"cannot make a PID namespace here: {holder.communicate(timeout=30)[1].strip()}")
        assert open(os.path.join(path, OWNER_FILE)).read().split()[0] == "1"  # its pid, in its own namespace
        remove_orphaned_shm(str(tmp_path))
        assert os.path.exists(path), "a live agent's directory was removed"
    finally:
        holder.communicate(input="", timeout=30)  # end of input: it exits, and its lock goes with it
    remove_orphaned_shm(str(tmp_path))
    assert not os.path.exists(path)


def test_the_newest_snapshot_of_a_rank_counts_only_those_made_since_the_attempt_began(tmp_path) -> None:
    """Acceptance 20B F3: a SIGKILL lost a rank's last step reports, not its snapshots: the
    exit line named step 957 and the restore step 960. An earlier attempt's snapshots (ahead of
    a restore) do not count."""
    rank = tmp_path / "rank1"
    rank.mkdir()
    for step in (12, 13, 20):
        (rank / snapshot_name(step)).write_text("{}")
    os.utime(rank / snapshot_name(20), (1000.0, 1000.0))  # the attempt before's
    (rank / f"{snapshot_name(14)}.tmp").write_text("{}")  # not complete
    began = os.stat(rank / snapshot_name(12)).st_mtime
    assert newest_snapshot(str(tmp_path), 1, since=began) == 13
    assert newest_snapshot(str(tmp_path), 1, since=0) == 20
    assert newest_snapshot(str(tmp_path), 0, since=0) == 0  # no directory
