"""torchrun's --duplicate-stdout-filters / --duplicate-stderr-filters: teed lines that contain a
filter string are also copied, with their console prefix, to one attempt_<n>/filtered_std*.log."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from e2e import run_unicron

from unicron.agent.logs import (
    FILTERED_STDERR,
    FILTERED_STDOUT,
    LineCopy,
    LogSpec,
    RunLogDir,
    Std,
    copied_lines,
    plan_rank_logs,
)
from unicron.agent.tee import ConsoleTee
from unicron.launch import parse_run_args
from unicron.launch.bridge import settings_from_config

FRUIT = ("apple", "orange")


# ---------------------------------------------------------------- which lines are copied


def test_a_line_is_copied_when_it_contains_any_needle() -> None:
    assert copied_lines(b"an apple a day", FRUIT) == ["an apple a day"]
    assert copied_lines(b"orange juice", FRUIT) == ["orange juice"]
    assert copied_lines(b"banana", FRUIT) == []
    assert copied_lines(b"Apple", FRUIT) == []  # case-sensitive substring, as torchrun's `in`
    assert copied_lines(b"", FRUIT) == []
    # an empty needle (torchrun's "a," gives ["a", ""]) matches every line, the empty one too
    assert copied_lines(b"banana", ("a,", "")) == ["banana"] and copied_lines(b"", ("",)) == [""]


def test_carriage_returns_end_lines_as_in_torchruns_text_mode_read() -> None:
    assert copied_lines(b"10% apple\r20% pear\r30% apple", ("apple",)) == ["10% apple", "30% apple"]
    assert copied_lines(b"apple\r", ("apple",)) == ["apple"]  # "\r\n" is one line end, not an extra line
    assert copied_lines(b"\r", ("",)) == [""]


def test_the_line_end_is_part_of_the_matched_text_unless_the_line_was_cut() -> None:
    assert copied_lines(b"loss 3", ("3\n",)) == ["loss 3"]
    assert copied_lines(b"loss 3", ("3\n",), terminated=False) == []
    assert copied_lines(b"a 3\rb 3", ("3\n",), terminated=False) == ["a 3"]


def test_undecodable_bytes_are_replaced_not_fatal() -> None:
    assert copied_lines(b"apple \xff\xfe", FRUIT) == ["apple \ufffd\ufffd"]


# ---------------------------------------------------------------- planning


def test_only_teed_streams_of_shown_ranks_are_copied(tmp_path: Path) -> None:
    spec = LogSpec(log_dir=str(tmp_path), redirects=Std.ERR, tee={0: Std.ALL, 1: Std.OUT, 2: Std.ALL},
                   local_ranks_filter=frozenset({0, 1}), duplicate_stdout_filters=FRUIT,
                   duplicate_stderr_filters=("err",))
    attempt = str(tmp_path / "attempt_0")
    plans = [plan_rank_logs(spec, attempt, local_rank=lr, rank=lr, role="r") for lr in range(3)]
    out_copy = LineCopy(os.path.join(attempt, FILTERED_STDOUT), FRUIT)
    err_copy = LineCopy(os.path.join(attempt, FILTERED_STDERR), ("err",))
    assert (plans[0].copy_stdout, plans[0].copy_stderr) == (out_copy, err_copy)
    # rank 1 redirects stderr but does not tee it: torchrun copies only teed streams
    assert (plans[1].copy_stdout, plans[1].copy_stderr) == (out_copy, None)
    # rank 2 is teed but hidden by --local-ranks-filter: torchrun does not tail it, so no copy
    assert (plans[2].copy_stdout, plans[2].copy_stderr) == (None, None)
    assert plan_rank_logs(LogSpec(log_dir=str(tmp_path), tee=Std.ALL), attempt, local_rank=0, rank=0,
                          role="r").copy_stdout is None
    assert plan_rank_logs(LogSpec(log_dir=os.devnull, tee=Std.ALL, duplicate_stdout_filters=FRUIT), None,
                          local_rank=0, rank=0, role="r").copy_stdout is None


def test_each_attempt_gets_its_own_empty_copy_files(tmp_path: Path) -> None:
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path), duplicate_stdout_filters=FRUIT), "job")
    assert logdir.run_dir is not None
    plans = logdir.prepare_attempt(0, [(0, 0)])
    attempt0 = Path(logdir.run_dir) / "attempt_0"
    # created even though nothing is teed, as torchrun opens it with the filters alone
    assert (attempt0 / FILTERED_STDOUT).read_bytes() == b"" and not (attempt0 / FILTERED_STDERR).exists()
    assert plans[0].copy_stdout is None
    (attempt0 / FILTERED_STDOUT).write_text("stale\n")
    logdir.prepare_attempt(0, [(0, 0)])  # a number used again gets a directory of its own, empty
    assert (Path(logdir.run_dir) / "attempt_0.2" / FILTERED_STDOUT).read_bytes() == b""
    assert (attempt0 / FILTERED_STDOUT).read_bytes() == b"stale\n"  # and the old one is kept (29B F2)
    logdir.prepare_attempt(1, [(0, 0)])
    assert (Path(logdir.run_dir) / "attempt_1" / FILTERED_STDOUT).read_bytes() == b""
    plain = RunLogDir(LogSpec(log_dir=str(tmp_path / "plain"), tee=Std.ALL), "job")
    plain.prepare_attempt(0, [(0, 0)])
    assert plain.run_dir is not None and not list(Path(plain.run_dir).rglob("filtered_*"))


# ---------------------------------------------------------------- the tee writes the copies


def test_tee_copies_matching_lines_of_every_rank_into_one_file(tmp_path: Path) -> None:
    logdir = RunLogDir(LogSpec(log_dir=str(tmp_path), tee=Std.ALL, duplicate_stdout_filters=FRUIT,
                               duplicate_stderr_filters=("oops",)), "job")
    plans = logdir.prepare_attempt(0, [(0, 0), (1, 1)])
    console_out, console_err = io.BytesIO(), io.BytesIO()
    tee = ConsoleTee(stdout=console_out, stderr=console_err, interval_s=0.01)
    finishers = [tee.follow_rank(plan) for plan in plans]
    out0, out1 = (Path(str(plan.stdout_path)) for plan in plans)
    err0 = Path(str(plans[0].stderr_path))
    out0.write_bytes(b"apple 0\nbanana 0\nan orange 0\nlast apple without newline")
    err0.write_bytes(b"oops 0\nfine 0\n")
    finishers[0]()  # rank 0 is done; rank 1 keeps copying into the same file afterwards
    deadline_poll(lambda: tee.pending() == 2)
    out1.write_bytes(b"orange 1\npear 1\n")
    finishers[1]()
    tee.close(timeout_s=30)
    assert tee.pending() == 0

    attempt = Path(str(logdir.attempt_dir(0)))
    assert (attempt / FILTERED_STDOUT).read_text().splitlines() == [
        "[default0]:apple 0", "[default0]:an orange 0", "[default0]:last apple without newline",
        "[default1]:orange 1",
    ]
    assert (attempt / FILTERED_STDERR).read_text() == "[default0]:oops 0\n"
    # the console still shows every line
    assert console_out.getvalue().decode().count("\n") == 6


def test_a_cut_overlong_line_is_matched_in_pieces(tmp_path: Path) -> None:
    copy = LineCopy(str(tmp_path / "copy.log"), ("apple",))
    log = tmp_path / "bar.log"
    log.write_bytes(b"apple" + b"x" * 100 + b"\n")
    tee = ConsoleTee(stdout=io.BytesIO(), max_line_bytes=50)
    tee.follow(str(log), "[p]:", copy=copy)()
    tee.close(timeout_s=30)
    assert (tmp_path / "copy.log").read_text() == "[p]:apple" + "x" * 100 + "\n"


def deadline_poll(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ---------------------------------------------------------------- command line


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def test_filters_reach_the_agent_without_the_old_warning(script: str) -> None:
    cfg = parse_run_args(["--tee", "3", "--duplicate-stdout-filters", "loss,,x,acc",
                          "--duplicate_stderr_filters", "warn", script], {})
    assert not cfg.warnings
    spec = settings_from_config(cfg).log_spec
    assert spec.duplicate_stdout_filters == ("loss,x", "acc") and spec.duplicate_stderr_filters == ("warn",)
    env = {"PET_DUPLICATE_STDOUT_FILTERS": "a,b"}
    assert parse_run_args([script], env).duplicate_stdout_filters == ("a", "b")


def test_filters_that_can_copy_nothing_warn(script: str) -> None:
    cfg = parse_run_args(["--tee", "1", "--duplicate-stdout-filters", "x", "--duplicate-stderr-filters", "y",
                          script], {})
    assert cfg.warnings == ("--duplicate-stderr-filters copies nothing without --tee 2 or 3 "
                            "(it copies only teed lines)",)
    cfg = parse_run_args(["--tee", "0:0,1:2", "--duplicate-stderr-filters", "y", script], {})
    assert not cfg.warnings
    cfg = parse_run_args(["--tee", "3", "--log-dir", os.devnull, "--duplicate-stdout-filters", "x", script], {})
    assert cfg.warnings == (f"--duplicate-stdout-filters copies nothing with --log-dir {os.devnull}",)
    assert not parse_run_args(["--duplicate-stdout-filters", "", script], {}).warnings  # '' is no filter


# ---------------------------------------------------------------- end to end

FRUIT_SCRIPT = """\
import os, sys
rank = os.environ["LOCAL_RANK"]
print(f"apple from {rank}")
print(f"banana from {rank}")
print(f"an orange, from {rank}")
print(f"apple on stderr from {rank}", file=sys.stderr)
print(f"last orange without newline {rank}", end="")
"""


def _attempt_dir(logs: Path) -> Path:
    (attempt,) = logs.glob("*/attempt_0")
    return attempt


def test_unicron_run_copies_matching_lines_of_both_ranks(workdir: Path) -> None:
    (workdir / "fruit.py").write_text(FRUIT_SCRIPT)
    common = ["run", "--standalone", "--nproc-per-node", "2", "--tee", "3"]
    code, out, err = run_unicron([*common, "--log-dir", str(workdir / "a"), "--duplicate-stdout-filters",
                                  "apple,orange", str(workdir / "fruit.py")], workdir, timeout=90)
    assert code == 0, err
    assert "[default1]:banana from 1" in out  # the console is unchanged
    attempt = _attempt_dir(workdir / "a")
    copied = (attempt / FILTERED_STDOUT).read_text().splitlines()
    for rank in (0, 1):
        mine = [line for line in copied if line.startswith(f"[default{rank}]:")]
        assert mine == [f"[default{rank}]:apple from {rank}", f"[default{rank}]:an orange, from {rank}",
                        f"[default{rank}]:last orange without newline {rank}"], copied
    assert len(copied) == 6, copied
    assert not (attempt / FILTERED_STDERR).exists()

    code, out, err = run_unicron([*common, "--log-dir", str(workdir / "b"), "--duplicate-stderr-filters",
                                  "apple", str(workdir / "fruit.py")], workdir, timeout=90)
    assert code == 0, err
    attempt = _attempt_dir(workdir / "b")
    assert not (attempt / FILTERED_STDOUT).exists()
    assert sorted((attempt / FILTERED_STDERR).read_text().splitlines()) == [
        "[default0]:apple on stderr from 0", "[default1]:apple on stderr from 1"]


def test_tee_of_stdout_leaves_stderr_as_the_worker_wrote_it(workdir: Path) -> None:
    """--tee 1 prefixes stdout only: stderr is not teed, so (as under torchrun) it reaches the
    console unprefixed, though unicron keeps a copy of it for the classifier."""
    (workdir / "fruit.py").write_text(FRUIT_SCRIPT)
    code, out, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--tee", "1",
                                  "--log-dir", str(workdir / "logs"), str(workdir / "fruit.py")], workdir, timeout=90)
    assert code == 0, err
    for rank in (0, 1):
        assert f"[default{rank}]:banana from {rank}" in out.splitlines()
        assert f"apple on stderr from {rank}" in err.splitlines()
    assert "]:apple on stderr" not in err
