"""Per-rank worker logs in torchrun's ``--log-dir`` layout, and the console tee.

Layout (as torch.distributed.elastic's ``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log
                                                        /stderr.log
                                                        /error.json   (TORCHELASTIC_ERROR_FILE)

``-r/--redirects`` sends a rank's streams to those files instead of the console; ``-t/--tee``
does the same *and* echoes every line to the agent's console with a prefix (torchrun's
``[<role><local_rank>]:``, or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). With
``--local-ranks-filter`` only the listed ranks reach the console; the others still write their
files. Without ``--log-dir`` a temporary directory is used, as torchrun does; ``--log-dir
/dev/null`` writes nothing and sets no error file.

The tee reads the files the worker writes (it never sits between the worker and its output), so
a slow console cannot block a worker, and a worker that dies has already put every byte it wrote
into the file: :meth:`ConsoleTee.finish` drains it to the end before it stops following.
"""

from __future__ import annotations

import enum
import io
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from string import Template
from typing import IO, Any, Protocol

from unicron.errors import UsageError

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


class Std(enum.IntFlag):
    """Which streams of a rank a ``--redirects`` / ``--tee`` value selects (torchrun's values)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


StdSpec = Std | Mapping[int, Std]

_STD_VALUE = re.compile(r"^[0-3]$")
_STD_MAPPING = re.compile(r"^\d+:[0-3](,\d+:[0-3])*$")


def parse_std(value: str, *, flag: str = "--redirects") -> StdSpec:
    """Parse ``3`` or ``0:3,1:0`` (local rank: value) as torchrun does."""
    text = value.strip()
    if _STD_VALUE.match(text):
        return Std(int(text))
    if _STD_MAPPING.match(text):
        mapping: dict[int, Std] = {}
        for item in text.split(","):
            rank, std = item.split(":")
            if int(rank) in mapping:
                raise UsageError(f"{flag}: local rank {int(rank)} is given twice in {value!r}")
            mapping[int(rank)] = Std(int(std))
        return mapping
    raise UsageError(
        f"{flag}: {value!r} is not 0-3 or a list of LOCAL_RANK:VALUE pairs such as 0:3,1:1 "
        "(0 none, 1 stdout, 2 stderr, 3 both)"
    )


def std_for_rank(spec: StdSpec, local_rank: int) -> Std:
    """The streams selected for one local rank (ranks missing from a mapping get NONE)."""
    if isinstance(spec, Std):
        return spec
    return Std(spec.get(local_rank, Std.NONE))


def parse_local_ranks_filter(value: str | None) -> frozenset[int] | None:
    """``0,2`` -> {0, 2}; empty or None -> None (every rank reaches the console)."""
    if value is None or not value.strip():
        return None
    try:
        ranks = frozenset(int(item) for item in value.split(","))
    except ValueError:
        raise UsageError(
            f"--local-ranks-filter: {value!r} is not a comma-separated list of integers, e.g. 0,1,2"
        ) from None
    if any(rank < 0 for rank in ranks):
        raise UsageError(f"--local-ranks-filter: {value!r} has a negative rank")
    return ranks


def line_prefix(template: str | None, *, role: str, rank: int, local_rank: int) -> str:
    """torchrun's tee prefix: ``[<role><local_rank>]:`` or the template with $role_name/$rank/$local_rank."""
    if template:
        return Template(template).safe_substitute(role_name=role, rank=rank, local_rank=local_rank)
    return f"[{role}{local_rank}]:"


@dataclass(frozen=True)
class LogSpec:
    """What the user asked for with --log-dir, -r, -t and --local-ranks-filter."""

    log_dir: str | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    prefix_template: str | None = None

    @property
    def discards_everything(self) -> bool:
        """``--log-dir /dev/null``: torchrun writes no files and sets an empty error file."""
        return self.log_dir == os.devnull


@dataclass(frozen=True)
class RankLogs:
    """Where one worker's streams go for one attempt.

    ``stdout_path``/``stderr_path`` None means the worker inherits the agent's console.
    ``tee_*`` means the file is also echoed to the console with ``prefix``.
    """

    local_rank: int
    rank: int
    directory: str | None
    stdout_path: str | None
    stderr_path: str | None
    tee_stdout: bool
    tee_stderr: bool
    error_file: str | None
    prefix: str


def plan_rank_logs(
    spec: LogSpec, attempt_dir: str | None, *, local_rank: int, rank: int, role: str
) -> RankLogs:
    """Decide (without touching the disk) where a rank's streams go; mirrors DefaultLogsSpecs.reify.

    ``attempt_dir`` is None for ``--log-dir /dev/null``.
    """
    prefix = line_prefix(spec.prefix_template, role=role, rank=rank, local_rank=local_rank)
    teed = std_for_rank(spec.tee, local_rank)
    # torchrun tees by redirecting into the file and tailing it, so tee implies redirect.
    redirected = std_for_rank(spec.redirects, local_rank) | teed
    if attempt_dir is None or spec.discards_everything:
        # torchrun with --log-dir /dev/null: no files, no error file, every stream on the console.
        return RankLogs(local_rank, rank, None, None, None, False, False, None, prefix)
    directory = os.path.join(attempt_dir, str(local_rank))
    stdout_path = os.path.join(directory, "stdout.log") if Std.OUT in redirected else None
    stderr_path = os.path.join(directory, "stderr.log") if Std.ERR in redirected else None
    tee_out = Std.OUT in teed
    tee_err = Std.ERR in teed
    shown = spec.local_ranks_filter is None or local_rank in spec.local_ranks_filter
    if not shown:
        # Filtered-out ranks keep their files but print nothing on the console.
        tee_out = tee_err = False
        stdout_path = stdout_path or os.devnull
        stderr_path = stderr_path or os.devnull
    return RankLogs(
        local_rank=local_rank,
        rank=rank,
        directory=directory,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
        tee_stdout=tee_out,
        tee_stderr=tee_err,
        error_file=os.path.join(directory, "error.json"),
        prefix=prefix,
    )


class RunLogDir:
    """The ``<log_dir>/<run_id>_<random>`` directory of one run, with a fresh ``attempt_<n>`` per attempt."""

    def __init__(self, spec: LogSpec, run_id: str) -> None:
        self.spec = spec
        self.run_id = run_id
        self.is_temporary = spec.log_dir is None
        self.root: str | None
        self.run_dir: str | None
        if spec.discards_everything:
            self.root = self.run_dir = None
            return
        if spec.log_dir is None:
            self.root = tempfile.mkdtemp(prefix="unicron_")
        else:
            if os.path.isfile(spec.log_dir):
                raise UsageError(f"--log-dir: {spec.log_dir} is a file, not a directory")
            try:
                os.makedirs(spec.log_dir, exist_ok=True)
            except OSError as err:
                raise UsageError(f"--log-dir: cannot create {spec.log_dir}: {err.strerror}") from None
            self.root = spec.log_dir
        self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self.root)

    def attempt_dir(self, attempt: int) -> str | None:
        if self.run_dir is None:
            return None
        return os.path.join(self.run_dir, f"attempt_{attempt}")

    def prepare_attempt(
        self, attempt: int, ranks: Iterable[tuple[int, int]], *, role: str = "default"
    ) -> list[RankLogs]:
        """Create ``attempt_<n>/<local_rank>/`` (emptied first, as torchrun does) for (local_rank, rank) pairs."""
        attempt_dir = self.attempt_dir(attempt)
        if attempt_dir is not None:
            shutil.rmtree(attempt_dir, ignore_errors=True)
            os.makedirs(attempt_dir)
        plans = []
        for local_rank, rank in ranks:
            plan = plan_rank_logs(self.spec, attempt_dir, local_rank=local_rank, rank=rank, role=role)
            if plan.directory is not None:
                os.makedirs(plan.directory, exist_ok=True)
            plans.append(plan)
        return plans

    def cleanup(self) -> None:
        """Remove the directory if it is a temporary one unicron made (a user's --log-dir is kept)."""
        if self.is_temporary and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


class Console(Protocol):
    """Where teed lines go: a text stream (sys.stdout) or a binary one."""

    def write(self, data: Any, /) -> Any: ...

    def flush(self) -> Any: ...


def write_to_console(stream: Console, data: bytes) -> None:
    """Write bytes to a text or binary stream, keeping order with what was written as text."""
    if isinstance(stream, (io.RawIOBase, io.BufferedIOBase)):
        stream.write(data)
        stream.flush()
        return
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        stream.flush()
        raw.write(data)
        raw.flush()
    else:
        stream.write(data.decode("utf-8", errors="replace"))
        stream.flush()


class _Follow:
    """One file being echoed: where it is read up to, and the unfinished last line."""

    def __init__(self, path: str, prefix: bytes, sink: Console) -> None:
        self.path = path
        self.prefix = prefix
        self.sink = sink
        self.handle: IO[bytes] | None = None
        self.partial = b""
        self.finished = False


class ConsoleTee:
    """Echoes log files to the console, each line prefixed, from one background thread.

    ``follow`` starts echoing a file; ``finish`` says its writer has exited, so the rest of the
    file is echoed (an unterminated last line gets a newline) and following stops. ``close``
    finishes everything and waits for the thread.
    """

    def __init__(
        self,
        stdout: Console | None = None,
        stderr: Console | None = None,
        *,
        interval_s: float = 0.05,
        max_line_bytes: int = 64 * 1024,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self.interval_s = interval_s
        self.max_line_bytes = max_line_bytes
        self._follows: list[_Follow] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def follow(self, path: str, prefix: str, *, stream: str = "stdout") -> Callable[[], None]:
        """Echo ``path`` to the console's ``stream`` ("stdout"/"stderr"); returns its ``finish``."""
        sink = (self._stderr or sys.stderr) if stream == "stderr" else (self._stdout or sys.stdout)
        entry = _Follow(path, prefix.encode(), sink)
        with self._lock:
            if self._closing:
                raise RuntimeError("ConsoleTee is closed")
            self._follows.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="unicron-tee", daemon=True)
                self._thread.start()
        self._wake.set()

        def finish() -> None:
            entry.finished = True
            self._wake.set()

        return finish

    def follow_rank(self, logs: RankLogs) -> Callable[[], None]:
        """Follow whatever of this rank is teed; the returned callable finishes all of it."""
        finishers = []
        if logs.tee_stdout and logs.stdout_path:
            finishers.append(self.follow(logs.stdout_path, logs.prefix, stream="stdout"))
        if logs.tee_stderr and logs.stderr_path:
            finishers.append(self.follow(logs.stderr_path, logs.prefix, stream="stderr"))

        def finish_all() -> None:
            for finish in finishers:
                finish()

        return finish_all

    def pending(self) -> int:
        """Files still being followed."""
        with self._lock:
            return len(self._follows)

    def close(self, timeout_s: float = 10.0) -> None:
        """Echo what is left of every file and stop. A console that blocks longer than timeout is left behind."""
        with self._lock:
            self._closing = True
            for entry in self._follows:
                entry.finished = True
            thread = self._thread
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the scan, so a wake during the scan is not lost
            with self._lock:
                follows = list(self._follows)
                closing = self._closing
            if not follows and closing:
                return
            progressed = False
            for entry in follows:
                # Read "finished" before reading the file: a finish that lands after the read
                # is seen next round, so no byte written before finish is ever skipped.
                finished = entry.finished
                progressed |= self._pump(entry)
                if finished:
                    while self._pump(entry):
                        pass
                    self._flush_partial(entry)
                    self._drop(entry)
            if not progressed:
                self._wake.wait(self.interval_s)

    def _pump(self, entry: _Follow) -> bool:
        """Echo the complete lines now in the file; True if anything was read."""
        if entry.handle is None:
            try:
                entry.handle = open(entry.path, "rb")
            except OSError:
                return False
        data = entry.handle.read(1 << 16)
        if not data:
            return False
        buffered = entry.partial + data
        lines = buffered.split(b"\n")
        entry.partial = lines.pop()
        if len(entry.partial) > self.max_line_bytes:
            # A line with no newline in sight (a progress bar with \r) is shown in pieces.
            lines.append(entry.partial)
            entry.partial = b""
        if lines:
            out = b"".join(entry.prefix + line + b"\n" for line in lines)
            self._emit(entry, out)
        return True

    def _flush_partial(self, entry: _Follow) -> None:
        if entry.partial:
            self._emit(entry, entry.prefix + entry.partial + b"\n")
            entry.partial = b""

    def _emit(self, entry: _Follow, data: bytes) -> None:
        try:
            write_to_console(entry.sink, data)
        except (OSError, ValueError):
            # A closed console (``unicron run | head``) must not stop the agent; the file keeps it all.
            pass

    def _drop(self, entry: _Follow) -> None:
        if entry.handle is not None:
            entry.handle.close()
        with self._lock:
            if entry in self._follows:
                self._follows.remove(entry)


def prefix_template_from_env(environ: Mapping[str, str]) -> str | None:
    """torchrun reads the tee prefix template from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE."""
    return environ.get(PREFIX_TEMPLATE_ENV) or None
