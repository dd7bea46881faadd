"""Shared plumbing of the side-by-side benchmarks (unicron vs torchrun on examples/train_gpt.py).

Both launchers are started the same way (``python -m torch.distributed.run`` and
``python -m unicron run``, same interpreter, same flags), every process tree is reaped, and the
training script reports what happened through files both launchers leave alone:
``--step-log DIR`` (every rank appends ``step unix_time attempt``) and ``--fault-stamp FILE``
(the wall time of an injected fault).
"""

from __future__ import annotations

import atexit
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from unicron.events import EVENTS_FILE, read_events  # noqa: E402

SCRIPT = REPO / "examples" / "train_gpt.py"
LAUNCHERS = ("torchrun", "unicron")
# Environment a launcher sets for its workers; a benchmark run from inside a job must not leak it.
_LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT"
                            r"|TORCHELASTIC_.*|PET_.*|UNICRON_.*|OMP_NUM_THREADS)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_cmd(
    launcher: str,
    script_args: Sequence[str],
    *,
    nproc: int = 2,
    nnodes: int = 1,
    node_rank: int = 0,
    endpoint: str | None = None,
    max_restarts: int = 0,
    log_dir: Path | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The same command line for both launchers: only the program differs."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run"]
    elif launcher == "unicron":
        cmd = [sys.executable, "-m", "unicron", "run"]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    if nnodes == 1:
        cmd += ["--standalone"]
    else:
        if endpoint is None:
            raise ValueError("a multi-node job needs an endpoint")
        cmd += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "bench"]
    cmd += ["--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts)]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    cmd += [*extra, str(SCRIPT), *script_args]
    return cmd


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not _LAUNCHER_VARS.match(k)}


@dataclass
class Launched:
    """A launcher process in its own session, its output lines kept with their arrival time."""

    cmd: list[str]
    log_path: Path
    started_at: float = 0.0
    env: dict[str, str] = field(default_factory=dict)  # on top of the cleaned environment
    lines: list[tuple[float, str]] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None
    _reader: threading.Thread | None = None
    _exit_ts: float | None = None

    def start(self) -> Launched:
        self.started_at = time.time()
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env={**clean_env(), **self.env}, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        with open(self.log_path, "w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                now = time.time()
                self.lines.append((now, line.rstrip("\n")))
                log.write(f"{now:.6f} {line}")
                log.flush()

    def first_line(self, pattern: str, after: float = 0.0) -> float | None:
        rx = re.compile(pattern)
        for ts, line in list(self.lines):
            if ts >= after and rx.search(line):
                return ts
        return None

    def exited_at(self) -> float | None:
        """Wall time at which the launcher was first seen to have exited (polling granularity)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            return None
        if self._exit_ts is None:
            self._exit_ts = time.time()
        return self._exit_ts

    def tree(self) -> list[psutil.Process]:
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, sig: int) -> None:
        """Signal the launcher and every descendant (workers live in sessions of their own)."""
        for p in self.tree():
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def reap(self) -> None:
        """Kill whatever is left of this launch and wait for it; safe to call twice."""
        if self.proc is None:
            return
        procs = self.tree()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=10)
        self.proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])


@contextmanager
def launched(cmds: Iterable[tuple[list[str], Path]], env: dict[str, str] | None = None) -> Iterator[list[Launched]]:
    """Start every command; reap them all on the way out, whatever happened."""
    runs: list[Launched] = []
    try:
        for cmd, log_path in cmds:
            runs.append(Launched(cmd, log_path, env=dict(env or {})).start())
        yield runs
    finally:
        for run in runs:
            run.reap()


def wait_for(pred: Callable[[], Any], timeout: float, interval: float = 0.02) -> Any:
    """Poll `pred` until it returns something truthy or `timeout` passes (then None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


@dataclass(frozen=True)
class StepRecord:
    step: int
    ts: float
    attempt: int


def read_step_logs(step_dir: Path) -> dict[int, list[StepRecord]]:
    """rank -> step records in file order; a torn last line (a killed writer) is skipped."""
    logs: dict[int, list[StepRecord]] = {}
    for path in sorted(step_dir.glob("rank*.txt")):
        rank = int(path.stem[4:])
        records = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                try:
                    records.append(StepRecord(int(parts[0]), float(parts[1]), int(parts[2])))
                except ValueError:
                    continue
        logs[rank] = records
    return logs


def all_ranks_reached(step_dir: Path, world: int, step: int, after: float = 0.0) -> float | None:
    """Time by which every rank had completed `step` (or more) after `after`, else None."""
    logs = read_step_logs(step_dir)
    if len(logs) < world:
        return None
    times = []
    for rank in range(world):
        hits = [r.ts for r in logs.get(rank, []) if r.step >= step and r.ts > after]
        if not hits:
            return None
        times.append(min(hits))
    return max(times)


def read_stamp(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def first_event(log_dir: Path, kinds: set[str], after: float) -> dict[str, Any] | None:
    """The earliest event of one of `kinds` at or after `after` in any events.jsonl under log_dir."""
    best: dict[str, Any] | None = None
    for path in log_dir.rglob(EVENTS_FILE):
        for event in read_events(path, kinds=kinds, since=after):
            if best is None or event["ts"] < best["ts"]:
                best = event
    return best


def unicron_works(timeout: float = 60.0) -> tuple[bool, str]:
    """Whether `python -m unicron run` can start here; the reason when it cannot."""
    try:
        res = subprocess.run([sys.executable, "-m", "unicron", "run", "--help"], cwd=REPO, env=clean_env(),
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, "`python -m unicron run --help` did not answer"
    if res.returncode != 0:
        last = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no output"]
        return False, f"`python -m unicron run --help` failed: {last[0]}"
    return True, ""


def pick_launchers(only: str | None) -> list[str]:
    """Both launchers unless --only; unicron is left out (with a note) where it cannot run."""
    wanted = [only] if only else list(LAUNCHERS)
    if "unicron" in wanted:
        ok, why = unicron_works()
        if not ok:
            print(f"note: unicron half not run: {why}", file=sys.stderr)
            wanted.remove("unicron")
    return wanted


def workdir(prefix: str) -> Path:
    """A fresh directory for one run's logs, removed when the benchmark exits unless
    ``UNICRON_BENCH_KEEP=1`` (then its path is in the launcher's log lines to inspect)."""
    path = Path(tempfile.mkdtemp(prefix=f"unicron-{prefix}-"))
    if os.environ.get("UNICRON_BENCH_KEEP") != "1":
        atexit.register(shutil.rmtree, path, True)
    return path


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt_s(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} s"


def ratio(unicron_value: float | None, torchrun_value: float | None) -> str:
    if unicron_value is None or torchrun_value is None or torchrun_value == 0:
        return "n/a"
    return f"{unicron_value / torchrun_value:.3f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def command_line() -> str:
    """The exact command that produced a table, to paste above it."""
    args = shlex.join(sys.argv[1:])
    return f".venv/bin/python {Path(sys.argv[0]).resolve().relative_to(REPO)} {args}".rstrip()


def machine_line() -> str:
    return f"{os.cpu_count()} CPUs, torch {_torch_version()}, Python {sys.version.split()[0]}"


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
