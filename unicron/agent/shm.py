"""The agent's snapshot directory in shared memory: creating it, finding what it holds, and
removing those of agents that died without cleaning up.

Workers that use ``unicron.State`` write one subdirectory per global rank (``rank<N>/``) with
data slots and JSON markers (``unicron.worker.snapslots``); the agent owns the directory, so
snapshots outlive the workers, and removes it when it exits.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import IO

from unicron.errors import UsageError
from unicron.worker import snapshot


def newest_snapshot(root: str, rank: int, since: float) -> int:
    """The newest step of ``rank`` with a complete snapshot made at ``since`` (wall clock) or
    later (an earlier attempt's may be ahead of a restore); 0 when there is none."""
    for step in reversed(snapshot.list_steps(snapshot.rank_dir(root, rank))):
        try:
            if os.stat(snapshot.snapshot_path(root, rank, step)).st_mtime >= since:
                return step
        except OSError:
            continue  # dropped meanwhile: a newer one replaced it
    return 0


def scan_snapshots(root: str) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Steps with a complete snapshot, per global rank (markers exist only once complete),
    and the bytes held per step over all local ranks (marker plus the data slot it names)."""
    found: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    try:
        entries = os.listdir(root)
    except OSError:
        return found, sizes
    for entry in entries:
        if not entry.startswith("rank") or not entry[4:].isdigit():
            continue
        steps = []
        for name in os.listdir(os.path.join(root, entry)):
            if name.startswith("step") and name.endswith(".pt") and name[4:-3].isdigit():
                step = int(name[4:-3])
                steps.append(step)
                path = os.path.join(root, entry, name)
                try:  # the marker is JSON naming the bytes of its data slot (unicron.worker.snapslots)
                    with open(path, encoding="utf-8") as f:
                        data = json.load(f).get("nbytes", 0)
                    size = os.path.getsize(path) + (data if isinstance(data, int) else 0)
                except (OSError, ValueError, AttributeError):
                    continue
                sizes[str(step)] = sizes.get(str(step), 0) + size
        found[entry[4:]] = sorted(steps)
    return found, sizes


OWNER_FILE = "agent.owner"


def make_shm_dir(run_id: str) -> str:
    """The agent's snapshot directory in shared memory, marked with its owner (pid and start
    time), after removing those whose agent died without cleaning up (SIGKILL, lost node)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return make_owned_dir(f"unicron-{_safe(run_id)[:40]}-", base)


# A unix socket's path must fit sockaddr_un.sun_path (107 bytes here): the longest one in the
# work directory is BASE/unicron-agent-XXXXXXXX/agent.sock.bell.
SOCKET_PATH_MAX = 107
_WORK_TAIL = len("/unicron-agent-XXXXXXXX/agent.sock.bell")
_SHORT_BASES = ("/tmp", "/var/tmp", "/dev/shm")


def work_base(tempdir: str, usable: Callable[[str], bool]) -> str | None:
    """Where the agent's work directory goes: the temp dir when its sockets' paths fit there,
    else the first short system temp dir that ``usable`` accepts (a long ``TMPDIR``, as on
    macOS-style or per-job scratch paths, must not stop the job); None if none does."""
    for base in (tempdir, *_SHORT_BASES):
        if len(base.rstrip("/")) + _WORK_TAIL <= SOCKET_PATH_MAX and usable(base):
            return base
    return None


def make_work_dir() -> str:
    """The agent's private directory (IPC socket, stack dumps), short enough for ipc:// paths,
    owner-marked and cleaned up the same way."""
    tempdir = tempfile.gettempdir()
    base = work_base(tempdir, lambda d: os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK))
    if base is None:
        raise UsageError(f"the temp directory {tempdir!r} is too long for the workers' socket (at most "
                         f"{SOCKET_PATH_MAX - _WORK_TAIL} characters) and none of {', '.join(_SHORT_BASES)} "
                         "is writable; set TMPDIR to a shorter directory")
    return make_owned_dir("unicron-agent-", base)


# The owner marks the agent holds open and locked for its life (never inherited: Python opens
# files close-on-exec, and the agent forks nothing that runs on without exec).
_HELD_MARKS: list[IO[str]] = []


def make_owned_dir(prefix: str, base: str) -> str:
    remove_orphaned_shm(base)
    path = tempfile.mkdtemp(prefix=prefix, dir=base)
    mark = open(os.path.join(path, OWNER_FILE), "w")  # noqa: SIM115 - held open for the agent's life
    try:
        fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)  # before the mark names us
    except OSError:
        pass  # a file system without locks: the pid and start time below still judge
    mark.write(f"{os.getpid()} {_start_time(os.getpid())}")
    mark.flush()
    _HELD_MARKS.append(mark)
    return path


def _locked_by_someone(mark_path: str) -> bool:
    """Whether a live agent holds the owner mark's lock: it works across PID namespaces (a
    container with ``--ipc=host`` shares ``/dev/shm`` but not pids) and survives pid reuse."""
    try:
        with open(mark_path) as probe:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when probe closes
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def _start_time(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return -1.0


def remove_orphaned_shm(base: str) -> None:
    try:
        entries = [e for e in os.listdir(base) if e.startswith("unicron-")]
    except OSError:
        return
    for entry in entries:
        try:
            with open(os.path.join(base, entry, OWNER_FILE)) as fh:
                pid_text, started = fh.read().split()
            pid, created = int(pid_text), float(started)
        except (OSError, ValueError):
            continue  # not ours to judge (no owner mark)
        if _locked_by_someone(os.path.join(base, entry, OWNER_FILE)):
            continue  # its agent lives, perhaps in another PID namespace where its pid means nothing here
        if _start_time(pid) != created:  # that agent is gone (or its pid was reused)
            shutil.rmtree(os.path.join(base, entry), ignore_errors=True)


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)
