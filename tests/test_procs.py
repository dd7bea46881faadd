"""The agent's process layer with real processes: spawn, logs and tee, wait_any, terminate_all, signals."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from unicron.agent.logs import (
    LogSpec,
    RunLogDir,
    Std,
    capture_stderr,
    line_prefix,
    parse_local_ranks_filter,
    parse_std,
    plan_rank_logs,
)
from unicron.agent.procs import (
    WorkerProcess,
    spawn,
    start_worker,
    wait_any,
)
from unicron.agent.signals import LauncherSignals, set_child_subreaper
from unicron.agent.tee import ConsoleTee
from unicron.agent.terminate import terminate_all
from unicron.errors import FatalUserError, UsageError, WorkerFailedError

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def wait_until(condition: Callable[[], object], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """No such process, or a zombie that is nobody's business of ours (re-parented to init)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() != os.getpid()
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def workers() -> Iterator[list[WorkerProcess]]:
    """Everything a test spawns goes in here and is stopped and reaped, whatever happens."""
    spawned: list[WorkerProcess] = []
    yield spawned
    terminate_all(spawned, grace_s=0.5)
    for worker in spawned:
        worker.close()


@pytest.fixture
def subreaper() -> Iterator[bool]:
    """Orphaned grandchildren re-parent to the test process, as they will to the agent."""
    enabled = set_child_subreaper(True)
    yield enabled
    set_child_subreaper(False)


def write_script(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def read_json_when_ready(path: Path, timeout_s: float = 30.0) -> dict:
    wait_until(path.exists, timeout_s, f"{path.name} to be written")
    return json.loads(path.read_text())


# ---------------------------------------------------------------- pure log planning


def test_parse_std_values_and_mappings() -> None:
    assert parse_std("0") is Std.NONE
    assert parse_std("3") == Std.ALL
    assert parse_std("0:3,1:0,12:2") == {0: Std.ALL, 1: Std.NONE, 12: Std.ERR}
    for bad in ["4", "a", "0:4", "0:1,", "0:1,0:2", ""]:
        with pytest.raises(UsageError):
            parse_std(bad)


def test_local_ranks_filter_parsing() -> None:
    assert parse_local_ranks_filter("0,2") == frozenset({0, 2})
    assert parse_local_ranks_filter(None) is None
    assert parse_local_ranks_filter("") is None
    for bad in ["0,x", "-1", "1,,2"]:
        with pytest.raises(UsageError):
            parse_local_ranks_filter(bad)


def test_plan_matches_torchrun_rules(tmp_path: Path) -> None:
    attempt = str(tmp_path / "attempt_0")
    # tee implies redirect; torchrun's default prefix is [<role><local_rank>]:
    plan = plan_rank_logs(LogSpec(tee=Std.OUT), attempt, local_rank=1, rank=5, role="trainer")
    assert plan.stdout_path == os.path.join(attempt, "1", "stdout.log")
    assert plan.stderr_path is None and plan.tee_stdout and not plan.tee_stderr
    assert plan.prefix == "[trainer1]:"
    assert plan.error_file == os.path.join(attempt, "1", "error.json")
    # a mapping applies per rank; a rank missing from it is Std.NONE
    spec = LogSpec(redirects={0: Std.ERR})
    assert plan_rank_logs(spec, attempt, local_rank=0, rank=0, role="d").stderr_path
    assert plan_rank_logs(spec, attempt, local_rank=1, rank=1, role="d").stderr_path is None
    # a filtered-out rank keeps its files but shows nothing: console streams go to /dev/null
    spec = LogSpec(tee=Std.OUT, local_ranks_filter=frozenset({0}))
    hidden = plan_rank_logs(spec, attempt, local_rank=1, rank=1, role="d")
    assert not hidden.tee_stdout and hidden.stdout_path and hidden.stdout_path.endswith("stdout.log")
    # hidden from the console, but its stderr kept for the classifier (acceptance pass 15)
    assert hidden.stderr_path is not None and hidden.stderr_path.endswith("stderr.log") and not hidden.tee_stderr
    # --log-dir /dev/null: everything on the console, no error file
    devnull = plan_rank_logs(
        LogSpec(log_dir=os.devnull, redirects=Std.ALL), None, local_rank=0, rank=0, role="d"
    )
    assert devnull.stdout_path is None and devnull.error_file is None
    # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE
    assert line_prefix("[${role_name}-${rank}/${local_rank}] ", role="r", rank=7, local_rank=3) == "[r-7/3] "


def test_log_dir_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_text("")
    with pytest.raises(UsageError, match="is a file"):
        RunLogDir(LogSpec(log_dir=str(file)), "job")


def test_a_log_dir_this_user_cannot_write_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance 19C F6: another user's existing directory was "internal error:
    PermissionError", exit 70. (Root may write anywhere, so the refusal is the kernel's, faked.)"""
    def refused(*args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    with pytest.raises(UsageError, match=f"--log-dir: cannot create logs in {tmp_path}: Permission denied"):
        RunLogDir(LogSpec(log_dir=str(tmp_path)), "job")


@pytest.mark.timeout(10)
def test_an_attempt_number_used_again_gets_a_fresh_directory_and_the_old_logs_stay(tmp_path: Path) -> None:
    """Acceptance 29B F2: a coordinator that restarted and re-created the job numbered attempts
    from 0 again, and the agent emptied attempt_0/, the stderr of the rank that failed in it lost."""
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path)), "j")
    (first,) = logdir.prepare_attempt(0, [(0, 0)])
    assert first.directory is not None
    Path(first.directory, "stderr.log").write_text("the first attempt's traceback\n")
    (again,) = logdir.prepare_attempt(0, [(0, 0)])
    (third,) = logdir.prepare_attempt(0, [(0, 0)])
    assert Path(first.directory, "stderr.log").read_text() == "the first attempt's traceback\n"
    assert logdir.run_dir is not None
    assert [Path(p.directory or "").parent.name for p in (first, again, third)] == ["attempt_0", "attempt_0.2",
                                                                                    "attempt_0.3"]
    assert logdir.attempt_dir(0) == str(Path(logdir.run_dir, "attempt_0.3"))  # where its stacks and error files go


def test_temporary_log_dir_when_none_given() -> None:
    logdir = RunLogDir(LogSpec(), "job")
    try:
        assert logdir.root is not None and os.path.isdir(logdir.root)
        assert logdir.run_dir is not None and os.path.basename(logdir.run_dir).startswith("job_")
        plans = logdir.prepare_attempt(0, [(0, 0)])
        assert plans[0].error_file is not None and os.path.isdir(os.path.dirname(plans[0].error_file))
    finally:
        logdir.cleanup()
    assert not os.path.exists(logdir.root)


# ---------------------------------------------------------------- logs, tee, prefixes

TALKER = """
    import os, sys, signal
    rank = os.environ["LOCAL_RANK"]
    for i in range(200):
        print(f"out {rank} line {i}")
        print(f"err {rank} line {i}", file=sys.stderr)
    sys.stdout.write(f"out {rank} last words without newline")
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)   # dies without any cleanup
"""


def test_log_dir_layout_tee_prefix_and_filter(tmp_path: Path, workers: list[WorkerProcess], capfd) -> None:
    script = write_script(tmp_path, "talker.py", TALKER)
    spec = LogSpec(log_dir=str(tmp_path / "logs"), tee=Std.ALL, local_ranks_filter=frozenset({0}))
    logdir = RunLogDir(spec, "job42")
    plans = logdir.prepare_attempt(3, [(0, 10), (1, 11)], role="default")
    console_out, console_err = io.BytesIO(), io.BytesIO()
    tee = ConsoleTee(stdout=console_out, stderr=console_err)
    for plan in plans:
        env = {"LOCAL_RANK": str(plan.local_rank), "PYTHONUNBUFFERED": "1"}
        workers.append(start_worker([PY, script], env, plan, tee=tee))
    wait_until(lambda: all(w.poll() is not None for w in workers), what="talkers to die")
    tee.close()
    assert [w.returncode for w in workers] == [-signal.SIGKILL, -signal.SIGKILL]

    assert logdir.run_dir is not None
    run_dir = Path(logdir.run_dir)
    assert run_dir.parent == tmp_path / "logs" and run_dir.name.startswith("job42_")
    for local_rank in (0, 1):
        rank_dir = run_dir / "attempt_3" / str(local_rank)
        out = (rank_dir / "stdout.log").read_text()
        err = (rank_dir / "stderr.log").read_text()
        assert f"out {local_rank} line 199\n" in out and out.endswith("last words without newline")
        assert f"err {local_rank} line 199" in err
        # the worker was told where to write its error file
        assert plans[local_rank].error_file == str(rank_dir / "error.json")

    shown_out = console_out.getvalue().decode().splitlines()
    shown_err = console_err.getvalue().decode().splitlines()
    # rank 0 only (the filter), every line prefixed, the unterminated last line not lost
    assert shown_out == [f"[default0]:out 0 line {i}" for i in range(200)] + [
        "[default0]:out 0 last words without newline"
    ]
    assert shown_err == [f"[default0]:err 0 line {i}" for i in range(200)]
    captured = capfd.readouterr()
    assert "out 1" not in captured.out and "err 1" not in captured.err


def test_unredirected_rank_writes_to_console_and_filtered_rank_to_nowhere(
    tmp_path: Path, workers: list[WorkerProcess], capfd
) -> None:
    script = write_script(tmp_path, "hello.py", "import os; print('hello from', os.environ['LOCAL_RANK'])\n")
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path), local_ranks_filter=frozenset({1})), "j")
    for plan in logdir.prepare_attempt(0, [(0, 0), (1, 1)]):
        workers.append(start_worker([PY, script], {"LOCAL_RANK": str(plan.local_rank)}, plan))
    wait_until(lambda: all(w.poll() is not None for w in workers), what="workers to exit")
    out = capfd.readouterr().out
    assert "hello from 1" in out and "hello from 0" not in out


def test_tee_finish_drains_everything_written(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    lines = [f"line {i:05d} " + "x" * 40 for i in range(5000)]  # well over one 64 KiB read
    log.write_text("\n".join(lines))  # the last line has no newline
    console = io.BytesIO()
    tee = ConsoleTee(stdout=console, interval_s=30)
    finish = tee.follow(str(log), "[p]:")
    finish()  # the writer is already dead: everything must still come out
    tee.close(timeout_s=30)
    assert console.getvalue().decode().splitlines() == ["[p]:" + line for line in lines]
    assert tee.pending() == 0


DYING_NOTICE = """\
import os, signal, sys, time
sys.stderr.write("unicron: injected fault on rank 0 after step 3: SIGKILL to itself\\n"); sys.stderr.flush()
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(60)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["die", "live"])
def test_sync_echoes_a_ranks_last_words_before_the_agent_speaks_of_it(
    tmp_path: Path, workers: list[WorkerProcess], how: str
) -> None:
    """Acceptance 33B F5: the agent's "exit on rank 3" came before the rank's own "injected
    fault on rank 3" notice, which the tee echoes from its file only at its next round. After
    ``sync`` what the rank wrote is on the console: at once, with no round due for 30 s."""
    script = write_script(tmp_path, "notice.py", DYING_NOTICE)
    plan = RunLogDir(LogSpec(log_dir=str(tmp_path / "logs")), "j").prepare_attempt(0, [(0, 0)])[0]
    plan = capture_stderr(plan)  # as the agent runs a rank: its stderr echoed unprefixed
    console = io.BytesIO()
    tee = ConsoleTee(stderr=console, interval_s=30)
    workers.append(start_worker([PY, script, how], {}, plan, tee=tee))
    assert plan.stderr_path is not None
    if how == "die":  # reaped, as the agent's poll sees the exit it is about to report
        wait_until(lambda: workers[0].poll() is not None, what="the rank to die")
    else:  # a rank that wrote its notice and still runs (an exception on its way, a hang)
        wait_until(lambda: Path(plan.stderr_path or "").read_bytes().endswith(b"\n"), what="the notice")
    assert tee.sync(timeout_s=10) is True
    assert b"injected fault on rank 0 after step 3" in console.getvalue()
    tee.close()


@pytest.mark.timeout(60)
def test_sync_gives_up_on_a_console_that_blocks_and_does_not_wait_for_it_again(tmp_path: Path) -> None:
    log = tmp_path / "stderr.log"
    log.write_text("first\n")
    stuck = _SlowConsole(0.0)
    stuck.stuck.set()
    tee = ConsoleTee(stdout=stuck, interval_s=0.01)
    tee.follow(str(log), "[p]:")
    started = time.monotonic()
    assert tee.sync(timeout_s=0.2) is False
    assert tee.sync(timeout_s=30) is False  # nothing taken since: the agent's loop is not held again
    assert time.monotonic() - started < 10
    assert tee.close(timeout_s=0.2) is False


class _SlowConsole(io.RawIOBase):
    """A console that takes each write after ``delay_s``, or never once ``stuck`` is set."""

    def __init__(self, delay_s: float) -> None:
        self.data = bytearray()
        self.delay_s = delay_s
        self.stuck = threading.Event()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        if self.stuck.is_set():
            threading.Event().wait(60)
        time.sleep(self.delay_s)  # the console's own pace, not a wait for a condition
        self.data += bytes(b)
        return len(b)


def test_close_waits_for_an_echo_that_is_behind_and_gives_up_on_a_console_that_blocks(tmp_path: Path) -> None:
    """Acceptance 19B F6: ranks that logged hundreds of MB on a busy host left the echo far
    behind when the job ended, and close() gave up after 10 s: lines lost, exit 0. A backlog
    is echoed to its end, however long it takes; a console that takes nothing is left behind,
    and close() says so (the agent then keeps the files and names them)."""
    log = tmp_path / "stderr.log"
    lines = [f"line {i:05d} " + "x" * 40 for i in range(20000)]  # about 20 reads of 64 KiB
    log.write_text("\n".join(lines) + "\n")
    console = _SlowConsole(0.05)  # 1 s of echo in all, 0.05 s of it between two reads
    tee = ConsoleTee(stdout=console, interval_s=0.01)
    tee.follow(str(log), "[p]:")()
    assert tee.close(timeout_s=0.3) is True
    assert console.data.decode().splitlines() == ["[p]:" + line for line in lines]

    stuck = _SlowConsole(0.0)
    stuck.stuck.set()
    tee = ConsoleTee(stdout=stuck, interval_s=0.01)
    tee.follow(str(log), "[p]:")()
    started = time.monotonic()
    assert tee.close(timeout_s=0.3) is False
    assert time.monotonic() - started < 5


def test_a_teed_stream_ends_lines_at_carriage_returns_as_torchrun_does(tmp_path: Path) -> None:
    log = tmp_path / "stdout.log"
    console = io.BytesIO()
    tee = ConsoleTee(stdout=console, interval_s=0.01)
    with open(log, "wb", buffering=0) as writer:
        finish = tee.follow(str(log), "[p]:")
        writer.write(b"a\rb\r")  # the \r may be half of a \r\n: nothing extra until the next read
        wait_until(lambda: console.getvalue() == b"[p]:a\n", timeout_s=10, what="the first line")
        writer.write(b"\nc\n10%\r20%\r")
    finish()
    tee.close(timeout_s=30)
    assert console.getvalue() == b"[p]:a\n[p]:b\n[p]:c\n[p]:10%\n[p]:20%\n"


def test_an_untouched_stream_shows_partial_lines_at_once_and_byte_for_byte(tmp_path: Path) -> None:
    # A worker's stderr that the user did not tee is echoed raw: a progress bar's "\r" updates
    # show as they are written (not when a newline finally comes), and no newline is added.
    log = tmp_path / "stderr.log"
    console = io.BytesIO()
    tee = ConsoleTee(stderr=console, interval_s=0.01)
    with open(log, "wb", buffering=0) as writer:
        finish = tee.follow(str(log), "[default0]:", stream="stderr", raw=True)
        for i in range(3):
            writer.write(f"\rprogress {i}".encode())
            wait_until(lambda i=i: console.getvalue().endswith(f"\rprogress {i}".encode()), timeout_s=10,
                       what=f"update {i} on the console before any newline")
        writer.write(b"\rdone\nlast words, unterminated")
    finish()
    tee.close(timeout_s=30)
    assert console.getvalue() == b"\rprogress 0\rprogress 1\rprogress 2\rdone\nlast words, unterminated"


def test_raw_streams_of_two_ranks_never_splice_a_line(tmp_path: Path) -> None:
    """Two ranks flood stderr at once (logging, warnings): each line reaches the console whole,
    though the files are read 64 KiB at a time, cut anywhere (torchrun's workers write to the
    console themselves, a line per write)."""
    console = io.BytesIO()
    tee = ConsoleTee(stderr=console, interval_s=0.01)
    finishes, total = [], 0
    for name in "ab":
        log = tmp_path / f"{name}.log"
        log.write_bytes(b"".join(f"{name} line {i:06d} {'x' * (i % 50)}\n".encode() for i in range(20000)))
        total += log.stat().st_size
    for name in "ab":  # both followed while still being written to: read in turns, 64 KiB at a time
        finishes.append(tee.follow(str(tmp_path / f"{name}.log"), "", stream="stderr", raw=True))
    wait_until(lambda: len(console.getvalue()) >= total, timeout_s=30, what="everything on the console")
    for finish in finishes:
        finish()
    tee.close(timeout_s=60)
    lines = console.getvalue().decode().split("\n")
    assert lines.pop() == ""
    bad = [line for line in lines if not re.fullmatch(r"[ab] line \d{6} x*", line)]
    assert not bad and len(lines) == 40000, bad[:3]


@pytest.mark.parametrize("raw", [True, False], ids=["untouched", "teed"])
def test_lines_of_hundreds_of_kb_from_two_ranks_reach_the_console_whole(tmp_path: Path, raw: bool) -> None:
    """Acceptance 25B F2: a config printed as one JSON line of 200 KB by two ranks at once came
    out spliced, each cut at 64 KiB, rank 1's inside rank 0's."""
    console = io.BytesIO()
    tee = ConsoleTee(stderr=console, interval_s=0.01)
    lines = {name: name.encode() * 300_000 for name in "ab"}
    writers = {name: open(tmp_path / f"{name}.log", "wb", buffering=0) for name in "ab"}
    finishes = [tee.follow(str(tmp_path / f"{name}.log"), "", stream="stderr", raw=raw) for name in "ab"]
    for name in "ab":  # one write each, as a print does; the tee reads them 64 KiB at a time, in turns
        writers[name].write(lines[name] + b"\n")
        writers[name].close()
    wait_until(lambda: console.getvalue().count(b"\n") >= 2, timeout_s=30, what="both lines on the console")
    for finish in finishes:
        finish()
    tee.close(timeout_s=60)
    assert sorted(console.getvalue().split(b"\n")) == [b"", lines["a"], lines["b"]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", [True, False], ids=["untouched", "teed"])
def test_a_line_of_many_mb_without_an_end_is_read_once_and_shown_whole(tmp_path: Path, monkeypatch, raw: bool) -> None:
    """Acceptance 33A F7: each 64 KiB read of a line with no end yet joined and re-scanned all of
    it held so far (quadratic: a 32 MiB line kept the launcher 8 s past the job's end). Every
    byte is now scanned for line ends about once, and the line still reaches the console whole."""
    import unicron.agent.tee as tee_module

    scanned = [0]

    class CountingLineEnd:
        def split(self, data: bytes) -> list[bytes]:
            scanned[0] += len(data)
            return re.split(rb"\r\n|\r|\n", data)

    monkeypatch.setattr(tee_module, "_LINE_END", CountingLineEnd())
    console = io.BytesIO()
    tee = ConsoleTee(stderr=console, interval_s=0.01, max_line_bytes=1 << 20)
    line = bytes(range(65, 91)) * ((6 << 20) // 26) + b"END"
    path = tmp_path / "rank.log"
    with open(path, "wb", buffering=0) as writer:
        writer.write(line + b"\n")
    finish = tee.follow(str(path), "", stream="stderr", raw=raw)
    finish()
    assert tee.close(timeout_s=30)
    if raw:  # byte for byte, as the worker wrote it
        assert console.getvalue() == line + b"\n"
    else:  # in pieces of about max_line_bytes, each a line of its own
        pieces = console.getvalue().removesuffix(b"\n").split(b"\n")
        assert b"".join(pieces) == line and len(pieces) == 6, [len(p) for p in pieces]
    assert scanned[0] <= 2 * len(line), f"{scanned[0]} bytes scanned for a line of {len(line)}"


def test_slow_console_does_not_block_the_worker(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    release = threading.Event()

    class StuckConsole(io.RawIOBase):
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:  # type: ignore[override]
            release.wait(60)
            self.data += bytes(b)
            return len(b)

    script = write_script(
        tmp_path, "chatty.py", "for i in range(20000): print('chatty line', i)\nprint('done')\n"
    )
    console = StuckConsole()
    tee = ConsoleTee(stdout=console, stderr=console)
    plan = RunLogDir(LogSpec(log_dir=str(tmp_path), tee=Std.OUT), "j").prepare_attempt(0, [(0, 0)])[0]
    worker = start_worker([PY, script], {}, plan, tee=tee)
    workers.append(worker)
    # The console is stuck, yet the worker finishes writing everything and exits.
    assert wait_any([worker], 60) == [worker] and worker.returncode == 0
    release.set()
    tee.close(timeout_s=30)
    lines = console.data.decode().splitlines()
    assert len(lines) == 20001 and lines[-1] == "[default0]:done"


# ---------------------------------------------------------------- exits and waiting


def test_wait_any_sees_an_exit_fast(workers: list[WorkerProcess]) -> None:
    worker = spawn(["sleep", "300"], {}, local_rank=0)
    workers.append(worker)
    other = spawn(["sleep", "300"], {}, local_rank=1)
    workers.append(other)
    assert wait_any([worker, other], 0.05) == []
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(worker.pid, signal.SIGKILL)

    # Scheduled, most likely while wait_any is blocked; the latency counts from the kill either way.
    threading.Timer(0.2, kill).start()
    exited = wait_any([worker, other], 30)
    latency = time.monotonic() - killed_at[0]
    print(f"wait_any latency: {latency * 1000:.2f} ms")
    assert exited == [worker] and worker.returncode == -signal.SIGKILL
    assert latency < 1.0
    assert other.poll() is None


def test_wait_any_without_pidfd_polls(workers: list[WorkerProcess]) -> None:
    worker = spawn([PY, "-c", "import sys; sys.exit(7)"], {}, local_rank=0)
    workers.append(worker)
    worker.close()  # drop the pidfd: the polling path must still see the exit
    started = time.monotonic()
    assert wait_any([worker], 30) == [worker]
    print(f"polling wait_any: {(time.monotonic() - started) * 1000:.1f} ms")
    assert worker.returncode == 7


def test_wait_any_wakes_on_a_wake_fd(workers: list[WorkerProcess]) -> None:
    worker = spawn(["sleep", "300"], {}, local_rank=0)
    workers.append(worker)
    read_fd, write_fd = os.pipe()
    try:
        threading.Timer(0.1, lambda: os.write(write_fd, b"x")).start()
        started = time.monotonic()
        assert wait_any([worker], 30, wake_fds=[read_fd]) == []
        assert time.monotonic() - started < 10
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_program_that_cannot_start_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FatalUserError, match="cannot start worker 0: /no/such/program: No such file"):
        spawn(["/no/such/program"], {}, local_rank=0)
    with pytest.raises(FatalUserError, match="cannot start worker 1"):
        spawn(["sleep", "1"], {}, local_rank=1, cwd=str(tmp_path / "missing"))


def test_a_node_out_of_resources_is_not_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # fork refused (a pids limit): the node's trouble, which a stop of the whole job as a user
    # error would misname; the agent leaves the job instead (the node is treated as lost).
    def refuse(*_a: object, **_k: object) -> None:
        raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))

    monkeypatch.setattr(subprocess, "Popen", refuse)
    with pytest.raises(WorkerFailedError, match="Resource temporarily unavailable") as failed:
        spawn(["sleep", "1"], {}, local_rank=0)
    assert not isinstance(failed.value, FatalUserError)


def test_exit_callback_runs_once(workers: list[WorkerProcess]) -> None:
    worker = spawn([PY, "-c", "pass"], {}, local_rank=0)
    workers.append(worker)
    calls: list[int] = []
    worker.add_exit_callback(lambda: calls.append(1))
    wait_until(lambda: worker.poll() is not None)
    worker.poll()
    worker.add_exit_callback(lambda: calls.append(2))
    assert calls == [1, 2] and worker.exited_at is not None


# ---------------------------------------------------------------- stopping whole trees

TREE = """
    import json, multiprocessing as mp, os, subprocess, sys, time

    def loader(q):
        q.put(subprocess.Popen(["sleep", "300"]).pid)   # a grandchild of the loader
        time.sleep(300)

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        loader_proc = ctx.Process(target=loader, args=(q,))
        loader_proc.start()
        sleeps = [subprocess.Popen(["sleep", "300"]).pid for _ in range(2)]
        escaped = subprocess.Popen(["sleep", "300"], start_new_session=True).pid  # left the group
        tree = {"loader": loader_proc.pid, "loader_child": q.get(), "sleeps": sleeps, "escaped": escaped}
        with open(sys.argv[1] + ".tmp", "w") as fh:
            json.dump(tree, fh)
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(300)
"""


def tree_pids(tree: dict) -> list[int]:
    return [tree["loader"], tree["loader_child"], *tree["sleeps"], tree["escaped"]]


def test_terminate_all_reaps_whole_trees(
    tmp_path: Path, workers: list[WorkerProcess], subreaper: bool
) -> None:
    script = write_script(tmp_path, "tree.py", TREE)
    pids_files = [tmp_path / f"tree{i}.json" for i in range(2)]
    for i, pids_file in enumerate(pids_files):
        workers.append(spawn([PY, script, str(pids_file)], {}, local_rank=i))
    trees = [read_json_when_ready(path) for path in pids_files]
    everything = [w.pid for w in workers] + [pid for tree in trees for pid in tree_pids(tree)]
    assert all(psutil.pid_exists(pid) for pid in everything)

    report = terminate_all(workers, grace_s=10)
    print(f"terminate_all: {report}")
    assert report.killed == () and report.survivors == ()
    assert set(everything) <= set(report.signalled)
    assert all(w.returncode == -signal.SIGTERM for w in workers)
    if subreaper:  # the agent reaps what re-parented to it: not even a zombie is left
        assert not [pid for pid in everything if psutil.pid_exists(pid)]
    wait_until(lambda: all(gone(pid) for pid in everything), what="the trees to be gone")
    assert report.elapsed_s < 10


def test_terminate_all_cleans_up_after_a_dead_leader(
    tmp_path: Path, workers: list[WorkerProcess], subreaper: bool
) -> None:
    script = write_script(tmp_path, "tree.py", TREE)
    pids_file = tmp_path / "tree.json"
    worker = spawn([PY, script, str(pids_file)], {}, local_rank=0)
    workers.append(worker)
    tree = read_json_when_ready(pids_file)
    worker.refresh_descendants()  # the agent's periodic snapshot, taken while the leader lives
    os.kill(worker.pid, signal.SIGKILL)  # the leader crashes; its children are orphaned
    assert wait_any([worker], 30) == [worker]
    assert not any(gone(pid) for pid in tree_pids(tree))
    terminate_all([worker], grace_s=10)
    wait_until(lambda: all(gone(pid) for pid in tree_pids(tree)), what="the orphans to be gone")


IGNORES_TERM = """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE)
    child.stdout.readline()
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(300)
"""


def test_sigterm_ignorer_is_killed_after_the_grace(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "stubborn.py", IGNORES_TERM)
    ready = tmp_path / "ready"
    worker = spawn([PY, script, str(ready)], {}, local_rank=0)
    workers.append(worker)
    wait_until(lambda: ready.exists() and ready.read_text(), what="the stubborn worker to be ready")
    child = int(ready.read_text())
    report = terminate_all([worker], grace_s=0.5)
    print(f"terminate_all: {report}")
    assert worker.returncode == -signal.SIGKILL
    assert {worker.pid, child} <= set(report.killed)
    assert 0.5 <= report.elapsed_s < 10
    wait_until(lambda: gone(child), what="the stubborn child to be gone")


EXITS_ON_ITS_OWN = """
import signal, subprocess, sys, time
def on_term(*_):
    open(sys.argv[1] + ".term", "w").write("handler ran")
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
deadline = time.monotonic() + float(sys.argv[2])  # its teardown: over by then, or stuck
while time.monotonic() < deadline:
    time.sleep(0.01)
open(sys.argv[1] + ".exited", "w").write(repr(time.time()))
sys.exit(3)
"""

TERM_NOTED = """
import signal, sys, time
def on_term(*_):
    open(sys.argv[1], "w").write(repr(time.time()))
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
open(sys.argv[1] + ".ready", "w").close()
time.sleep(300)
"""


@pytest.mark.parametrize("teardown_s", [0.5, 300.0])
def test_a_worker_already_exiting_is_not_signalled_unless_it_lingers(
        tmp_path: Path, workers: list[WorkerProcess], teardown_s: float) -> None:
    """A rank whose script raised is on its way out: torchrun never signals it (it learns of the
    failure from the exit), and its SIGTERM handler run in the middle of its teardown printed a
    traceback that was not the job's cause (acceptance 23C F1). Its children are stopped as
    ever; a teardown that does not end is signalled after ``exiting_s``."""
    script = write_script(tmp_path, "exiting.py", EXITS_ON_ITS_OWN)
    ready = tmp_path / "ready"
    worker = spawn([PY, script, str(ready), str(teardown_s)], {}, local_rank=0)
    other = spawn([PY, "-c", "import time; time.sleep(300)"], {}, local_rank=1)
    workers += [worker, other]
    wait_until(lambda: ready.exists() and ready.read_text(), what="the worker to be ready")
    child = int(ready.read_text())
    report = terminate_all([worker, other], grace_s=30, exiting=[worker.pid], exiting_s=2.0)
    print(f"terminate_all: {report}")
    assert other.returncode == -signal.SIGTERM and report.killed == ()
    wait_until(lambda: gone(child), what="the exiting worker's child to be gone")
    if teardown_s < 2.0:
        assert worker.returncode == 3 and not (tmp_path / "ready.term").exists()
        assert worker.pid not in report.signalled and child in report.signalled
    else:
        assert worker.returncode == 143 and (tmp_path / "ready.term").read_text() == "handler ran"
        assert worker.pid in report.signalled and 2.0 <= report.elapsed_s < 20


def test_a_faults_stop_lets_the_exiting_worker_finish_before_the_others_are_signalled(
        tmp_path: Path, workers: list[WorkerProcess]) -> None:
    """As under torchrun, which stops the others once the failed rank exited: its atexit hooks,
    and a checkpoint it was still writing with its peers, are not cut off (acceptance 23C F1)."""
    ready, noted = tmp_path / "ready", tmp_path / "noted"
    worker = spawn([PY, write_script(tmp_path, "exiting.py", EXITS_ON_ITS_OWN), str(ready), "1.0"], {}, local_rank=0)
    other = spawn([PY, write_script(tmp_path, "noted.py", TERM_NOTED), str(noted)], {}, local_rank=1)
    workers += [worker, other]
    wait_until(lambda: ready.exists() and ready.read_text() and (tmp_path / "noted.ready").exists(),
               what="both workers to be ready")
    report = terminate_all([worker, other], grace_s=30, exiting=[worker.pid], exiting_s=30, exiting_first=True)
    print(f"terminate_all: {report}")
    assert worker.returncode == 3 and other.returncode == 143 and report.killed == ()
    assert float(noted.read_text()) >= float((tmp_path / "ready.exited").read_text())


def test_a_worker_that_raised_and_does_not_exit_is_said_and_waited_for_up_to_the_limit(
        tmp_path: Path, workers: list[WorkerProcess]) -> None:
    """A non-daemon thread keeps its interpreter (acceptance 24A F4: the stop waited the whole
    grace period without a word): said after 5 s, then signalled at the limit with the others."""
    ready = tmp_path / "ready"
    worker = spawn([PY, write_script(tmp_path, "exiting.py", EXITS_ON_ITS_OWN), str(ready), "300"], {}, local_rank=0)
    workers.append(worker)
    wait_until(lambda: ready.exists() and ready.read_text(), what="the worker to be ready")
    said: list[list[int]] = []
    report = terminate_all([worker], grace_s=30, exiting=[worker.pid], exiting_s=6.5, exiting_first=True,
                           lingering=said.append)
    assert said == [[worker.pid]] and worker.returncode == 143 and 6.5 <= report.elapsed_s < 20


def test_a_stopped_worker_is_continued_so_it_exits_on_sigterm(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    """A SIGSTOPped process holds SIGTERM until continued: without SIGCONT it would only go at
    SIGKILL, after the whole grace period."""
    worker = spawn([PY, "-c", "import time; time.sleep(300)"], {}, local_rank=0)
    workers.append(worker)
    os.kill(worker.pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(worker.pid).status() == psutil.STATUS_STOPPED, what="the worker to stop")
    report = terminate_all([worker], grace_s=60)
    print(f"terminate_all: {report}")
    assert worker.returncode == -signal.SIGTERM and report.killed == ()


def test_terminate_all_uses_the_clock_for_the_grace(tmp_path: Path, workers: list[WorkerProcess]) -> None:
    script = write_script(tmp_path, "stubborn.py", IGNORES_TERM)
    ready = tmp_path / "ready"
    worker = spawn([PY, script, str(ready)], {}, local_rank=0)
    workers.append(worker)
    wait_until(lambda: ready.exists() and ready.read_text(), what="the stubborn worker to be ready")
    ticks = iter(range(10**6))
    # A clock where each reading is 1000 s later: the 600 s grace is over at the first look.
    report = terminate_all([worker], grace_s=600, clock=lambda: 1000.0 * next(ticks))
    assert worker.returncode == -signal.SIGKILL and worker.pid in report.killed


# ---------------------------------------------------------------- the launcher's signals

LAUNCHER = """
    import sys, time
    from unicron.agent.procs import running, spawn, wait_any
    from unicron.agent.signals import LauncherSignals, set_child_subreaper
    set_child_subreaper(True)
    worker_code = (
        "import subprocess, time; subprocess.Popen(['sleep', '300']); time.sleep(300)"
    )
    with LauncherSignals() as signals:
        workers = [spawn([sys.executable, "-c", worker_code], {}, local_rank=i) for i in range(2)]
        print(" ".join(str(w.pid) for w in workers), flush=True)
        while running(workers) and signals.signum is None:
            wait_any(running(workers), 30, wake_fds=[signals.fileno()])
        report = signals.stop_workers(workers, grace_s=float(sys.argv[1]))
        print("codes", " ".join(str(w.returncode) for w in workers), flush=True)
    sys.exit(signals.exit_code or 0)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signal_and_exits_128_plus_signum(tmp_path: Path, signum: int) -> None:
    script = write_script(tmp_path, "launcher.py", LAUNCHER)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher = subprocess.Popen([PY, script, "5"], env=env, stdout=subprocess.PIPE, text=True)
    worker_pids: list[int] = []
    try:
        assert launcher.stdout is not None
        worker_pids = [int(pid) for pid in launcher.stdout.readline().split()]
        assert len(worker_pids) == 2
        # the workers' sleep children exist before the signal is sent
        wait_until(lambda: all(psutil.Process(pid).children() for pid in worker_pids), what="worker children")
        grandchildren = [c.pid for pid in worker_pids for c in psutil.Process(pid).children()]
        started = time.monotonic()
        launcher.send_signal(signum)
        code = launcher.wait(timeout=30)
        elapsed = time.monotonic() - started
        rest = launcher.stdout.read()
        print(f"launcher exited {code} in {elapsed:.3f}s; {rest.strip()}")
        assert code == 128 + signum
        assert f"codes {-signum} {-signum}" in rest  # the workers got the same signal
        assert elapsed < 20  # not waiting out a timeout (a bound, not a timing: the machine is noisy)
        wait_until(lambda: all(gone(pid) for pid in worker_pids + grandchildren), what="no orphans")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in worker_pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_launcher_signals_restore_handlers() -> None:
    before = signal.getsignal(signal.SIGHUP)
    with LauncherSignals() as signals:
        assert signal.getsignal(signal.SIGHUP) != before
        os.kill(os.getpid(), signal.SIGHUP)
        wait_until(lambda: signals.signum == signal.SIGHUP, what="the handler to run")
        assert signals.exit_code == 128 + signal.SIGHUP
        assert os.read(signals.fileno(), 16)  # the wake-up byte is there
    assert signal.getsignal(signal.SIGHUP) == before


def test_a_signal_delivered_twice_at_once_is_one_signal_a_later_or_other_one_is_a_second() -> None:
    """coreutils' timeout sends SIGTERM to the launcher and then to its process group: a script's
    SIGTERM handler must get the grace period, not be SIGKILLed by the duplicate."""
    with LauncherSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: signals.signum == signal.SIGTERM, what="the handler to run")
        assert not signals.escalated
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # no condition to poll: the point is that time passes
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: signals.escalated, what="the later signal to count as a second one")
    with LauncherSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # another signal at once: the user means it
        wait_until(lambda: signals.escalated, what="a different signal to count as a second one")


def test_a_process_traced_from_outside_names_its_tracer(workers: list[WorkerProcess]) -> None:
    """``gdb -p`` attaches with ptrace: the rank stops, its liveness thread with it, and only
    /proc says why (acceptance 23B F5: a hang was called 1.5 s after gdb attached)."""
    import ctypes

    from unicron.agent.proctree import tracer_of

    worker = spawn([PY, "-c", "import time; time.sleep(300)"], {}, local_rank=0)
    workers.append(worker)
    assert tracer_of(worker.pid) is None
    libc = ctypes.CDLL(None, use_errno=True)
    ptrace_attach, ptrace_detach = 16, 17
    if libc.ptrace(ptrace_attach, worker.pid, None, None) != 0:
        pytest.skip(f"cannot ptrace here: errno {ctypes.get_errno()}")
    try:
        os.waitpid(worker.pid, 0)  # the attach stop
        assert tracer_of(worker.pid) == os.getpid()
    finally:
        libc.ptrace(ptrace_detach, worker.pid, None, None)
    wait_until(lambda: tracer_of(worker.pid) is None, what="the detach")
    assert tracer_of(2 ** 22 + 12345) is None  # no such process
