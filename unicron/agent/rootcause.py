"""Why workers failed: one ``WorkerFailure`` per dead worker, the root cause, and its report.

A worker decorated with torch's ``@record`` (torch.distributed.elastic.multiprocessing.errors)
writes ``TORCHELASTIC_ERROR_FILE`` as::

    {"message": {"message": "ValueError: boom",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}

or, in the older/plain form, ``{"message": "text", "timestamp": 1700000000}``. When there is no
error file the last lines of the worker's ``stderr.log`` stand in for the traceback.

Like torchrun, the root cause is the failure seen first. torchrun compares the error file's
whole-second timestamps; here the file's modification time (sub-second, written at the moment
of the exception) refines it, and a worker without an error file counts from when its exit was
seen, so that a rank SIGKILLed first is not hidden behind the peers that failed because of it.

Everything here except ``read_tail``, ``build_failure`` and ``failure_of`` is pure.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from unicron.detect.faults import signal_cause, stderr_summary
from unicron.smallfile import NotReadable, read_regular

if TYPE_CHECKING:
    from unicron.agent.procs import WorkerProcess

DEFAULT_TAIL_LINES = 40
_TAIL_READ_BYTES = 64 * 1024
ERROR_FILE_MAX_BYTES = 8 * 1024 * 1024  # torchrun's own error files are a few KB


@dataclass(frozen=True)
class ErrorRecord:
    """What a worker's error file says."""

    message: str
    traceback: str | None
    timestamp: float | None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerFailure:
    """One worker that ended badly (a non-zero exit code or a signal)."""

    rank: int
    local_rank: int
    host: str
    pid: int
    exitcode: int  # negative: killed by signal -exitcode, as subprocess reports it
    signal_name: str | None
    timestamp: float  # unix seconds: when the failure happened, as best known
    error: ErrorRecord | None = None
    error_file: str | None = None
    stderr_tail: str = ""

    @property
    def traceback(self) -> str | None:
        """The worker's own account: its recorded traceback, else its stderr tail."""
        if self.error is not None:
            return self.error.traceback or self.error.message
        return self.stderr_tail or None

    @property
    def summary(self) -> str:
        """One line: the exception message, else what stderr says went wrong (``stderr_summary``);
        for a death by signal, the signal, and what stderr says only where it reads as its cause."""
        if self.error is not None and self.error.message.strip():
            return self.error.message.strip().splitlines()[0]
        if self.exitcode < 0:
            cause = signal_cause(self.stderr_tail)
            return describe_exit(self.exitcode) + (f": {cause}" if cause else "")
        return stderr_summary(self.stderr_tail)


def signal_name(exitcode: int) -> str | None:
    """SIGKILL for -9; None for a normal exit code."""
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def describe_exit(exitcode: int) -> str:
    name = signal_name(exitcode)
    if name is None:
        return f"exit code {exitcode}"
    return f"signal {name} ({-exitcode})"


def parse_error_file(text: str) -> ErrorRecord | None:
    """Parse an error file's text; None if it is empty or not what ``@record`` writes."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than Python recurses
        return None
    if not isinstance(data, dict) or "message" not in data:
        return None
    message = data["message"]
    if isinstance(message, str):
        return ErrorRecord(message, None, _as_float(data.get("timestamp")), data)
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    callstack = extra.get("py_callstack")
    text_message = message.get("message")
    return ErrorRecord(
        message=str(text_message) if text_message is not None else "",
        traceback=str(callstack) if callstack else None,
        timestamp=_as_float(extra.get("timestamp")),
        data=data,
    )


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def tail_lines(text: str, max_lines: int = DEFAULT_TAIL_LINES) -> str:
    """The last ``max_lines`` lines of ``text`` (no trailing newline)."""
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-max_lines:]) if max_lines > 0 else ""


def failure_time(record: ErrorRecord | None, error_file_mtime: float | None, exited_at: float) -> float:
    """When the failure happened: the error file's (refined) time, else when the exit was seen."""
    if record is None or record.timestamp is None:
        if record is not None and error_file_mtime is not None:
            return error_file_mtime
        return exited_at
    # The file's timestamp is whole seconds; its mtime says where within that second.
    if error_file_mtime is not None and record.timestamp <= error_file_mtime < record.timestamp + 2:
        return error_file_mtime
    return record.timestamp


def make_failure(
    *,
    rank: int,
    local_rank: int,
    host: str,
    pid: int,
    exitcode: int,
    exited_at: float,
    error_text: str | None = None,
    error_file: str | None = None,
    error_file_mtime: float | None = None,
    stderr_text: str = "",
    tail: int = DEFAULT_TAIL_LINES,
) -> WorkerFailure:
    """Build a failure from what was read about a dead worker (pure)."""
    record = parse_error_file(error_text) if error_text else None
    return WorkerFailure(
        rank=rank,
        local_rank=local_rank,
        host=host,
        pid=pid,
        exitcode=exitcode,
        signal_name=signal_name(exitcode),
        timestamp=failure_time(record, error_file_mtime, exited_at),
        error=record,
        error_file=error_file if record is not None else None,
        stderr_tail=tail_lines(stderr_text, tail),
    )


def read_tail(path: str | None, max_bytes: int = _TAIL_READ_BYTES) -> str:
    """The last ``max_bytes`` of a file as text ('' if there is no such file)."""
    if not path or path == os.devnull:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return ""
    if size > max_bytes:
        data = data.split(b"\n", 1)[-1]  # drop the cut first line
    return data.decode("utf-8", errors="replace")


def read_error_file(path: str, max_bytes: int = ERROR_FILE_MAX_BYTES) -> tuple[str | None, float | None]:
    """The text and mtime of a worker's error file; (None, None) when it is missing or is not
    a regular file of at most ``max_bytes`` (the worker chose what is there: a FIFO would block
    the read, a device or a huge file would fill memory)."""
    try:
        data = read_regular(path, max_bytes)
        mtime = os.stat(path).st_mtime
    except (OSError, NotReadable):
        return None, None
    return data.decode("utf-8", errors="replace"), mtime


def build_failure(
    *,
    rank: int,
    local_rank: int,
    pid: int,
    exitcode: int,
    exited_at: float,
    error_file: str | None,
    stderr_file: str | None,
    host: str | None = None,
    tail: int = DEFAULT_TAIL_LINES,
) -> WorkerFailure:
    """Read a dead worker's error file and stderr log and build its ``WorkerFailure``."""
    error_text: str | None = None
    mtime: float | None = None
    if error_file and error_file != os.devnull:
        error_text, mtime = read_error_file(error_file)
    return make_failure(
        rank=rank,
        local_rank=local_rank,
        host=host if host is not None else socket.gethostname(),
        pid=pid,
        exitcode=exitcode,
        exited_at=exited_at,
        error_text=error_text,
        error_file=error_file,
        error_file_mtime=mtime,
        stderr_text=read_tail(stderr_file),
        tail=tail,
    )


def failure_of(worker: WorkerProcess, host: str | None = None) -> WorkerFailure:
    """The ``WorkerFailure`` of an exited ``procs.WorkerProcess``, from its error file and stderr log."""
    code = worker.poll()
    if code is None:
        raise ValueError(f"worker rank {worker.rank} (pid {worker.pid}) is still running")
    logs = worker.logs
    return build_failure(
        rank=worker.rank,
        local_rank=worker.local_rank,
        pid=worker.pid,
        exitcode=code,
        exited_at=worker.exited_at or time.time(),
        error_file=logs.error_file if logs else None,
        stderr_file=logs.stderr_path if logs else None,
        host=host,
    )


def order_failures(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    """Earliest first (the root cause), ties by rank."""
    return sorted(failures, key=lambda f: (f.timestamp, f.rank))


def root_cause(failures: Sequence[WorkerFailure]) -> WorkerFailure:
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    return order_failures(failures)[0]


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="milliseconds")


def _indent(text: str, pad: str = "  ") -> str:
    return "\n".join(pad + line if line else line for line in text.rstrip("\n").splitlines())


def format_root_cause(failures: Sequence[WorkerFailure]) -> str:
    """The text unicron prints when workers fail: the root cause with its traceback, then the rest."""
    ordered = order_failures(failures)
    if not ordered:
        return "no worker failed"
    first = ordered[0]
    lines = [
        f"Root cause: rank {first.rank} (local_rank {first.local_rank}) on {first.host} "
        f"failed with {describe_exit(first.exitcode)}, pid {first.pid}, at {_when(first.timestamp)}"
    ]
    if first.error is not None:
        source = f"traceback (from {first.error_file}):" if first.error_file else "traceback:"
        lines.append(source)
        lines.append(_indent(first.traceback or "<empty>"))
    elif first.stderr_tail and first.signal_name is not None:
        lines.append(f"no traceback: the process was killed by {first.signal_name}; the last lines of its stderr:")
        lines.append(_indent(first.stderr_tail))
    elif first.stderr_tail:
        lines.append("no error file; last lines of its stderr:")
        lines.append(_indent(first.stderr_tail))
    elif first.signal_name is not None:
        lines.append(f"no traceback: the process was killed by {first.signal_name}")
    else:
        lines.append(
            "no traceback: the worker wrote no error file (decorate its main with "
            "torch.distributed.elastic.multiprocessing.errors.record) and its stderr "
            "was not captured (use --redirects 2 or --tee 2)"
        )
    if len(ordered) > 1:
        lines.append(f"Other failed ranks ({len(ordered) - 1}):")
        for failure in ordered[1:]:
            summary = failure.summary.removeprefix(describe_exit(failure.exitcode)).removeprefix(": ")
            lines.append(
                f"  rank {failure.rank} (local_rank {failure.local_rank}) on {failure.host}: "
                f"{describe_exit(failure.exitcode)}, pid {failure.pid}" + (f": {summary}" if summary else "")
            )
    return "\n".join(lines)
