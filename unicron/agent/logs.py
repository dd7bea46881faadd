"""Per-rank worker logs in torchrun's ``--log-dir`` layout (the console tee is ``unicron.agent.tee``).

Layout (as torch.distributed.elastic's ``DefaultLogsSpecs``)::

    <log_dir>/<run_id>_<random>/attempt_<n>/<local_rank>/stdout.log
                                                        /stderr.log
                                                        /error.json   (TORCHELASTIC_ERROR_FILE)

``-r/--redirects`` sends a rank's streams to those files instead of the console; ``-t/--tee``
does the same *and* echoes every line to the agent's console with a prefix (torchrun's
``[<role><local_rank>]:``, or ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``). With
``--local-ranks-filter`` only the listed ranks reach the console; the others still write their
files. Without ``--log-dir`` a temporary directory is used, as torchrun does; ``--log-dir
/dev/null`` writes nothing and sets no error file. ``--duplicate-stdout-filters`` (and
``-stderr-``) also copy the teed lines that contain any filter string, prefixed, into one
``attempt_<n>/filtered_stdout.log`` (``filtered_stderr.log``) shared by the attempt's ranks.

The tee reads the files the worker writes (it never sits between the worker and its output), so
a slow console cannot block a worker, and a worker that dies has already put every byte it wrote
into the file: :meth:`unicron.agent.tee.ConsoleTee.follow`'s finish drains it to the end before it stops following.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from string import Template

from unicron.errors import UsageError

PREFIX_TEMPLATE_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
FILTERED_STDOUT = "filtered_stdout.log"
FILTERED_STDERR = "filtered_stderr.log"


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


def copied_lines(line: bytes, needles: tuple[str, ...], *, terminated: bool = True) -> list[str]:
    """The parts of one console line (no ``\\n``) that a duplicate filter copies.

    torchrun reads the log in text mode, so ``\\r`` ends a line too, and a line matches when its
    decoded text, line end included, contains any needle (an empty needle matches every line).
    """
    pieces = line.decode("utf-8", errors="replace").split("\r")
    if len(pieces) > 1 and not pieces[-1]:
        pieces.pop()  # "\r\n" (or a trailing "\r") ends the line before it, not an extra one
    last = len(pieces) - 1
    return [piece for i, piece in enumerate(pieces)
            if any(needle in (piece + "\n" if terminated or i < last else piece) for needle in needles)]


@dataclass(frozen=True)
class LineCopy:
    """Where a teed stream's matching lines are copied: one file per attempt, for all its ranks."""

    path: str
    needles: tuple[str, ...]


@dataclass(frozen=True)
class LogSpec:
    """What the user asked for with --log-dir, -r, -t and --local-ranks-filter."""

    log_dir: str | None = None
    redirects: StdSpec = Std.NONE
    tee: StdSpec = Std.NONE
    local_ranks_filter: frozenset[int] | None = None
    prefix_template: str | None = None
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()

    @property
    def keeps_workers_off_console(self) -> bool:
        """Every rank's stdout and stderr go to files only (``--redirects 3``, no ``--tee``):
        nothing of the workers' reaches the terminal, which a live status line may then own."""
        return self.redirects == Std.ALL and self.tee == Std.NONE and not self.discards_everything

    @property
    def discards_everything(self) -> bool:
        """``--log-dir /dev/null``: torchrun writes no files and sets an empty error file."""
        return self.log_dir == os.devnull


@dataclass(frozen=True)
class RankLogs:
    """Where one worker's streams go for one attempt.

    ``stdout_path``/``stderr_path`` None means the worker inherits the agent's console.
    ``tee_*`` means the file is also echoed to the console with ``prefix``; ``copy_*`` (teed
    streams only, as in torchrun) says where its lines that match a duplicate filter go too.
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
    copy_stdout: LineCopy | None = None
    copy_stderr: LineCopy | None = None
    stderr_prefixed: bool = True  # False: stderr is echoed as the worker wrote it (not teed by the user)


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
        # Filtered-out ranks keep their files but print nothing on the console. Their stderr is
        # kept all the same: the classifier and the failure report read it (a hidden rank's CUDA
        # error), and every rank's stderr.log exists.
        tee_out = tee_err = False
        stdout_path = stdout_path or os.devnull
        stderr_path = stderr_path or os.path.join(directory, "stderr.log")
    out_filters, err_filters = spec.duplicate_stdout_filters, spec.duplicate_stderr_filters
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
        copy_stdout=LineCopy(os.path.join(attempt_dir, FILTERED_STDOUT), out_filters)
        if tee_out and out_filters else None,
        copy_stderr=LineCopy(os.path.join(attempt_dir, FILTERED_STDERR), err_filters)
        if tee_err and err_filters else None,
    )


class RunLogDir:
    """The ``<log_dir>/<run_id>_<random>`` directory of one run, with a fresh ``attempt_<n>`` per attempt."""

    def __init__(self, spec: LogSpec, run_id: str) -> None:
        self.spec = spec
        self.run_id = run_id
        self.is_temporary = spec.log_dir is None
        self._attempt_dirs: dict[int, str] = {}  # attempt number -> its directory (see _fresh_attempt_dir)
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
                self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=spec.log_dir)
            except OSError as err:  # read-only, full, or another user's directory
                raise UsageError(f"--log-dir: cannot create logs in {spec.log_dir}: {err.strerror}") from None
            self.root = spec.log_dir
            return
        self.run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self.root)

    def discard_worker_logs(self) -> None:
        """Without ``--log-dir``, a worker's stderr that the user did not redirect is copied to a
        temporary directory only for the failure report (the classifier reads its tail; the
        console showed it): once the job succeeded nobody reads it, and a chatty stderr (tqdm,
        NCCL_DEBUG) left tens of MB per run in the temp dir (acceptance pass 14). What the user
        asked for stays, as torchrun keeps it in its temp dir: streams redirected or teed
        (``-r``, ``-t``: their only copy), error files, the filtered copies, the event log."""
        if not self.is_temporary or self.run_dir is None:
            return
        for attempt in os.listdir(self.run_dir):
            attempt_dir = os.path.join(self.run_dir, attempt)
            if not attempt.startswith("attempt_") or not os.path.isdir(attempt_dir):
                continue
            for name in os.listdir(attempt_dir):
                rank_dir = os.path.join(attempt_dir, name)
                asked = std_for_rank(self.spec.redirects, int(name)) | std_for_rank(self.spec.tee, int(name)) \
                    if name.isdigit() else Std.ERR
                if Std.ERR not in asked:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(rank_dir, "stderr.log"))
                with contextlib.suppress(OSError):
                    os.rmdir(rank_dir)  # only if nothing else is there
            with contextlib.suppress(OSError):
                os.rmdir(attempt_dir)

    def attempt_dir(self, attempt: int) -> str | None:
        if self.run_dir is None:
            return None
        return self._attempt_dirs.get(attempt) or os.path.join(self.run_dir, f"attempt_{attempt}")

    def _fresh_attempt_dir(self, attempt: int) -> str | None:
        """``attempt_<n>``, or ``attempt_<n>.<k>`` (the first free k from 2) when the number was
        used already in this run: a coordinator that restarted and re-created the job counts
        from 0 again, and emptying the directory lost the earlier attempt's logs, the stderr of
        the rank that failed included (acceptance 29B F2)."""
        if self.run_dir is None:
            return None
        path, k = os.path.join(self.run_dir, f"attempt_{attempt}"), 1
        while os.path.lexists(path):
            k += 1
            path = os.path.join(self.run_dir, f"attempt_{attempt}.{k}")
        self._attempt_dirs[attempt] = path
        return path

    def prepare_attempt(
        self, attempt: int, ranks: Iterable[tuple[int, int]], *, role: str = "default"
    ) -> list[RankLogs]:
        """Create ``attempt_<n>/<local_rank>/`` (a fresh one: never an existing directory emptied)
        for (local_rank, rank) pairs.

        The filtered copies exist (empty) whenever their filters are set, even if no rank is teed, as in torchrun.
        """
        attempt_dir = self._fresh_attempt_dir(attempt)
        if attempt_dir is not None:
            os.makedirs(attempt_dir)
            for name, filters in ((FILTERED_STDOUT, self.spec.duplicate_stdout_filters),
                                  (FILTERED_STDERR, self.spec.duplicate_stderr_filters)):
                if filters:
                    open(os.path.join(attempt_dir, name), "wb").close()
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


def prefix_template_from_env(environ: Mapping[str, str]) -> str | None:
    """torchrun reads the tee prefix template from TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE."""
    return environ.get(PREFIX_TEMPLATE_ENV) or None


def capture_stderr(plan: RankLogs) -> RankLogs:
    """Always keep a worker's stderr in a file (the classifier reads its tail).

    When the user did not redirect it, the file is echoed to the console unprefixed, so the
    console shows what torchrun would show: a stream that is not teed is the worker's own, even
    when its stdout is teed with a prefix (``--tee 1``).
    """
    if plan.stderr_path is not None or plan.directory is None:
        return plan
    return replace(plan, stderr_path=os.path.join(plan.directory, "stderr.log"), tee_stderr=True,
                   stderr_prefixed=False)


NO_SPACE = ("[Errno 28]", "No space left on device", "[Errno 122]", "Disk quota exceeded")


def full_copy_note(logs: RankLogs, message: str) -> str:
    """What to add to a rank's "no space left" error when the file system of unicron's own copy
    of its stderr is the full one: the script's `print(..., file=sys.stderr)` fails there, and
    nothing else says that file is unicron's (acceptance 19B F7); "" otherwise."""
    if logs.stderr_path is None or not any(s in message for s in NO_SPACE):
        return ""
    directory = os.path.dirname(logs.stderr_path)
    try:
        vfs = os.statvfs(directory)
    except OSError:
        return ""
    if vfs.f_bavail > 0:
        return ""
    return (f" (the file system of unicron's copy of this rank's stderr, {directory}, is full: free it, "
            "or point --log-dir (or TMPDIR) elsewhere)")
