"""Registry of the unicron runs alive on this machine, so `unicron status` finds them.

Each coordinator writes ``<runs dir>/<job>.<pid>.json`` (mode 0600, it names the secret file) and
removes it when it stops. Entries whose pid is gone are ignored and cleaned.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from unicron.errors import ConfigError
from unicron.smallfile import NotReadable, read_regular

RUN_ENTRY_MAX_BYTES = 64 * 1024  # an entry is a few hundred bytes (paths, a job id)

@dataclass(frozen=True)
class RunInfo:
    job: str
    endpoint: str
    pid: int
    secret_file: str
    log_dir: str
    started_at: float


def default_runs_base() -> str:
    """``/tmp``, whatever ``TMPDIR`` says: a run started under a batch job's own TMPDIR must be
    found by `unicron status` from a shell without it (the temp dir only where /tmp is unusable)."""
    return "/tmp" if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()


def runs_dir(create: bool = True) -> Path:
    """The registry's directory (created, unless ``create`` is False: a reader such as `unicron
    status` writes nothing, acceptance 25C F5): ``UNICRON_RUNS_DIR``, else ``/tmp/unicron-runs-UID``.
    ``ConfigError`` naming where it came from when it cannot be used, or when the default one is
    not this user's own: in a shared /tmp another user could make it first, and plant runs in
    this user's `unicron status` or remove theirs."""
    given = os.environ.get("UNICRON_RUNS_DIR")
    path = Path(given or os.path.join(default_runs_base(), f"unicron-runs-{os.getuid()}"))
    source = "UNICRON_RUNS_DIR" if given else "the runs directory"
    if not create and not os.path.lexists(path):
        return path  # nothing was ever registered there
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.lstat()
    except OSError as err:
        raise ConfigError(f"{source}: cannot use {path} as the directory of live runs: "
                          f"{err.strerror or err}") from None
    if not given and (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise ConfigError(f"{source} {path} is not this user's own (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}): remove it, or set UNICRON_RUNS_DIR")
    return path


def _entry(job: str, pid: int) -> Path:
    # Keyed by the process too: two runs that share a job id (the same --rdzv-id at two
    # endpoints) each keep their own entry, and the first to end removes only its own.
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    return runs_dir() / f"{safe}.{pid}.json"


def register_run(info: RunInfo) -> Path:
    """Write the run's entry. ``ConfigError`` naming the directory when it cannot be written.
    Its paths are made absolute: `unicron status` runs from any directory (`--log-dir logs`)."""
    info = replace(info, secret_file=os.path.abspath(info.secret_file) if info.secret_file else "",
                   log_dir=os.path.abspath(info.log_dir) if info.log_dir else "")
    path = _entry(info.job, info.pid)
    tmp = path.with_suffix(".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(info), fh)
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):  # a partial entry, if one was made
            tmp.unlink()
        source = "UNICRON_RUNS_DIR" if os.environ.get("UNICRON_RUNS_DIR") else "the runs directory"
        raise ConfigError(f"{source}: cannot use {path.parent} as the directory of live runs: "
                          f"{err.strerror or err}") from None
    return path


def register_run_or_warn(info: RunInfo, warn: Callable[[str], object]) -> bool:
    """``register_run`` for a launcher: a run trains without its entry, so a directory that
    cannot be used is a warning (``unicron status`` then needs ``--endpoint``), not a stop."""
    try:
        register_run(info)
    except ConfigError as err:
        warn(f"{err}; `unicron status` will not find this run without --endpoint")
        return False
    return True


def write_secret_file(directory: str | os.PathLike[str], secret: bytes, warn: Callable[[str], object]) -> str:
    """Keep the job's secret (mode 0600) where ``unicron status`` finds it; returns its path, or
    "" with a warning when it cannot be written (a full disk): the job runs without it."""
    path = Path(directory) / "secret"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(secret)
    except OSError as err:
        warn(f"cannot keep the job's secret in {path} ({err.strerror}); `unicron status` will need "
             "UNICRON_SECRET or --secret-file")
        return ""
    return str(path)


def unregister_run(job: str, pid: int | None = None) -> None:
    """Remove the entry this process (or ``pid``) wrote for ``job``."""
    try:
        _entry(job, os.getpid() if pid is None else pid).unlink()
    except (OSError, ConfigError):  # never registered (the directory could not be used)
        pass


def list_runs() -> list[RunInfo]:
    """Live runs, newest first; stale entries (dead pid, unreadable) are removed."""
    found: list[RunInfo] = []
    for path in runs_dir(create=False).glob("*.json"):
        try:
            # Bounded and regular only: a FIFO there hung `unicron status`, /dev/zero filled memory (27C F7)
            info = RunInfo(**json.loads(read_regular(path, RUN_ENTRY_MAX_BYTES).decode()))
        except (OSError, ValueError, TypeError):
            continue
        if not _well_formed(info):  # a hand edit, another version's: one such entry hid every run (21C F6)
            continue
        if not psutil.pid_exists(info.pid):
            path.unlink(missing_ok=True)
            continue
        found.append(info)
    return sorted(found, key=lambda r: r.started_at, reverse=True)


def _well_formed(info: RunInfo) -> bool:
    texts = (info.job, info.endpoint, info.secret_file, info.log_dir)
    return (all(isinstance(t, str) for t in texts) and type(info.pid) is int and 0 < info.pid < 1 << 31
            and isinstance(info.started_at, (int, float)) and not isinstance(info.started_at, bool)
            and math.isfinite(info.started_at))


SECRET_MAX_BYTES = 64 << 10  # as ``unicron run`` reads one: /dev/zero is refused, not read until memory runs out


def secret_from_file(path: str) -> bytes:
    """A secret file's key, or ``ConfigError`` saying why there is none (unreadable, empty)."""
    try:
        key = read_secret(path)
    except OSError as err:
        raise ConfigError(f"cannot read secret file {path}: {err.strerror or err}") from None
    if not key:
        raise ConfigError(f"secret file {path} is empty")
    return key


def read_secret(path: str) -> bytes:
    """A secret file's key (stripped); OSError naming what is wrong (not a regular file, too big)."""
    try:
        return read_regular(path, SECRET_MAX_BYTES).strip()
    except NotReadable as err:
        raise OSError(f"it {err}") from None
