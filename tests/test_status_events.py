"""`unicron events`: reading a run's events.jsonl back, filtered by kind, rank and time."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from unicron.errors import InputError, UnicronError, UsageError
from unicron.events import EventLog
from unicron.status.commands import register
from unicron.status.events_view import find_events_file, parse_time

NOW = 1_750_000_000.0


def invoke(args: list[str]) -> tuple[int, str]:
    """Run a command as the lead's main() does: a UnicronError becomes its exit code."""
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, args, standalone_mode=False)
    if isinstance(result.exception, UnicronError):
        return result.exception.exit_code, str(result.exception)
    if result.exception is not None:
        raise result.exception
    return 0, result.stdout


@pytest.fixture()
def run_log(tmp_path: Path) -> Path:
    """A real event log written by EventLog, as a run would write it."""
    path = tmp_path / "logs" / "gpt-demo" / "events.jsonl"
    log = EventLog(path, job="gpt-demo", node="trn-a")
    log.emit("attempt_start", ts=NOW - 600, attempt=0, world_size=4)
    log.emit("fault", ts=NOW - 300, rank=1, kind_detail="exit", exitcode=-9, signal="SIGKILL")
    log.emit("decision", ts=NOW - 299, attempt=0, action="restart", severity="SEV2")
    log.emit("restored", ts=NOW - 290, ranks=[0, 1, 2, 3], step=805)
    log.emit("fault", ts=NOW - 60, rank=3, kind_detail="hang")
    log.close()
    with open(path, "a") as fh:
        fh.write('{"ts": 1, "kind": "torn')  # a crash mid-line: skipped
    return path


def test_parse_time_forms() -> None:
    assert parse_time("1750000000", NOW) == 1_750_000_000.0
    assert parse_time("1750000000.5", NOW) == 1_750_000_000.5
    assert parse_time("-5m", NOW) == NOW - 300
    assert parse_time("-30s", NOW) == NOW - 30
    assert parse_time("-2h", NOW) == NOW - 7200
    assert parse_time("-1d", NOW) == NOW - 86400
    assert parse_time("90s ago", NOW) == NOW - 90
    iso = datetime.fromtimestamp(NOW, tz=timezone.utc).isoformat()
    assert parse_time(iso, NOW) == NOW
    assert parse_time("2025-06-15T15:06:40Z", NOW) == datetime(2025, 6, 15, 15, 6, 40, tzinfo=timezone.utc).timestamp()
    local = datetime.fromtimestamp(NOW).replace(microsecond=0).isoformat()  # naive = local time
    assert parse_time(local, NOW) == float(int(NOW))
    for bad in ("yesterday", "5m", "-5x", "", "nan", "1e400", "-inf"):  # 27C F12: nan filtered nothing
        with pytest.raises(UsageError, match="bad time"):
            parse_time(bad, NOW)


def test_find_events_file_picks_the_newest_run(tmp_path: Path) -> None:
    old = tmp_path / "run-a" / "events.jsonl"
    new = tmp_path / "run-b" / "attempt" / "events.jsonl"
    for p in (old, new):
        p.parent.mkdir(parents=True)
        p.write_text("{}\n")
    os.utime(old, (time.time() - 100, time.time() - 100))
    assert find_events_file(tmp_path) == new
    assert find_events_file(old) == old
    with pytest.raises(InputError, match="no events.jsonl under"):
        find_events_file(_empty_dir(tmp_path))
    with pytest.raises(InputError, match="no such file"):
        find_events_file(tmp_path / "missing")


def test_a_path_that_cannot_be_read_is_one_error_naming_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance 19C F7: another user's run (its directory 0700) was "internal error:
    PermissionError", exit 70, and its parent "no events.jsonl under DIR" in silence."""
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(InputError, match="cannot read .*a-file/events.jsonl: Not a directory"):
        find_events_file(afile / "events.jsonl")
    theirs = tmp_path / "theirs" / "run"
    theirs.mkdir(parents=True)
    (theirs / "events.jsonl").write_text("{}\n")
    real_scandir = os.scandir

    def refused(path):  # what a 0700 directory of another user does (root reads anything)
        if str(path) == str(theirs):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", refused)
    with pytest.raises(InputError, match=r"no events.jsonl under .* \(1 directory could not be read, e.g. .*theirs/run\)"):
        find_events_file(tmp_path / "theirs")


def _empty_dir(base: Path) -> Path:
    d = base / "empty"
    d.mkdir()
    return d


def test_json_lines_filtered_by_kind_and_rank(run_log: Path) -> None:
    code, out = invoke(["events", str(run_log), "--json", "--kind", "fault"])
    assert code == 0
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["rank"] for e in events] == [1, 3]
    code, out = invoke(["events", str(run_log.parent.parent), "--json", "--rank", "1"])
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds == ["fault", "restored"]  # "restored" names rank 1 in its ranks list
    code, out = invoke(["events", str(run_log), "--json", "-k", "decision", "-k", "restored"])
    assert [json.loads(line)["kind"] for line in out.splitlines()] == ["decision", "restored"]


def test_time_window(run_log: Path) -> None:
    since, until = str(NOW - 299.5), str(NOW - 100)
    code, out = invoke(["events", str(run_log), "--json", "--since", since, "--until", until])
    assert code == 0 and [json.loads(line)["kind"] for line in out.splitlines()] == ["decision", "restored"]
    code, out = invoke(["events", str(run_log), "--json", "--last", "2"])
    assert [json.loads(line)["ts"] for line in out.splitlines()] == [NOW - 290, NOW - 60]


def test_relative_since_uses_the_clock(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, job="j")
    log.emit("old", ts=time.time() - 3600)
    log.emit("recent", ts=time.time() - 10)
    log.close()
    code, out = invoke(["events", str(path), "--json", "--since", "-5m"])
    assert code == 0 and [json.loads(line)["kind"] for line in out.splitlines()] == ["recent"]


def test_table(run_log: Path) -> None:
    code, out = invoke(["events", str(run_log)])
    assert code == 0
    assert "5 events" in out
    for text in ("attempt_start", "fault", "decision", "restored", "SIGKILL", "0,1,2,3", "trn-a"):
        assert text in out
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(NOW - 300))
    assert stamp in out


def test_bad_inputs_are_one_clear_error(tmp_path: Path, run_log: Path) -> None:
    assert invoke(["events", str(tmp_path / "nope")]) == (2, f"{tmp_path / 'nope'}: no such file or directory")
    code, msg = invoke(["events", str(run_log), "--since", "soon"])
    assert code == 2 and msg.startswith("bad time 'soon'")
    code, msg = invoke(["events", str(run_log), "--since", "-1m", "--until", "-2h"])
    assert code == 2 and "is after --until" in msg
    code, msg = invoke(["events", str(_empty_dir(tmp_path))])
    assert code == 2 and msg.startswith("no events.jsonl under")


def test_a_file_that_is_no_event_log_is_named_as_such(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n[1, 2]\n{\"kind\": \"fault\"}\n\n")
    code, msg = invoke(["events", str(text)])
    assert (code, msg) == (2, f"{text}: not an event log (none of its 3 line(s) is a unicron event)")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    code, msg = invoke(["events", str(binary)])
    assert code == 2 and "not an event log" in msg
    binary.write_bytes(b"\x00\xffgarbage")  # no newline at all: not a torn event (acceptance pass 14)
    code, msg = invoke(["events", str(binary)])
    assert code == 2 and "not an event log" in msg
    empty = tmp_path / "events.jsonl"
    empty.write_text("")
    assert invoke(["events", str(empty), "--json"]) == (0, "")  # a run that logged nothing yet


def test_events_of_odd_shapes_are_filtered_without_error(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"ts": 1, "kind": "a", "ranks": 5}\n{"ts": true, "kind": "b"}\n{"ts": 2, "kind": "c", "ranks": [5]}\n')
    code, out = invoke(["events", str(path), "--rank", "5", "--json"])
    assert code == 0 and [json.loads(line)["kind"] for line in out.splitlines()] == ["c"]


def test_a_log_whose_only_line_is_torn_is_empty_not_foreign(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"ts": 1, "kind": "agent_st')  # the launcher died writing its first event
    assert invoke(["events", str(path), "--json"]) == (0, "")


@pytest.mark.parametrize("bad", [
    '{"ts": NaN, "kind": "fault"}', '{"ts": 1e300, "kind": "fault"}', '{"ts": -1e20, "kind": "fault"}',
    '{"ts": 3, "kind": "deep", "x": ' + "[" * 100000 + "]" * 100000 + "}",  # deeper than Python parses
    '{"ts": 3, "kind": "deep", "x": ' + "[" * 980 + "]" * 980 + "}",  # parses, but could not be shown
], ids=["nan", "huge", "negative", "unparsable-depth", "deep"])
def test_a_line_no_clock_or_writer_of_ours_made_is_skipped_in_both_modes(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"ts": 1, "kind": "a"}\n' + bad + '\n{"ts": 2, "kind": "b", "nested": {"ok": [1, {"x": [2]}]}}\n')
    code, out = invoke(["events", str(path), "--json"])
    assert code == 0 and [json.loads(line)["kind"] for line in out.splitlines()] == ["a", "b"], out
    code, out = invoke(["events", str(path)])
    assert code == 0 and "2 events" in out, out
    app = typer.Typer()
    register(app)
    said = CliRunner().invoke(app, ["events", str(path), "--json"], standalone_mode=False).stderr
    # acceptance 27B F8: skipped in silence
    assert said == f"unicron: skipped 1 line(s) of {path} that are no unicron event (corrupt, or written by something else)\n"


def test_a_long_log_is_printed_in_tables_that_read_as_one(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps({"ts": 1_700_000_000 + i, "kind": f"k{i}", "rank": i}) + "\n" for i in range(1200)))
    code, out = invoke(["events", str(path)])
    assert code == 0 and out.count("1200 events") == 1 and out.count("details") == 1, out[:500]
    rows = [line for line in out.splitlines() if line[:1].isdigit()]
    assert [line.split()[2] for line in rows] == [f"k{i}" for i in range(1200)]
    assert len({line.index(" k") for line in rows}) == 1  # one kind column across the tables


@pytest.mark.timeout(60)
def test_a_wide_terminal_shows_a_long_value_whole_and_a_narrow_one_stays_tidy(tmp_path: Path) -> None:
    """Acceptance 29C F4: every value was cut at 48 characters whatever the width, so a hang
    decision's culprit analysis never showed."""
    path = tmp_path / "events.jsonl"
    reason = "hang: ranks 0-6 wait in allreduce for rank 7, whose stack is in the data loader " \
             "(read from /mnt/data shard 00412); culprit rank 7 on node trn-b excluded END"
    log = EventLog(path, job="gpt-demo", node="trn-a")
    log.emit("decision", ts=NOW, attempt=0, action="reconfigure", severity="SEV1", reason=reason, culprits=[7])
    log.close()
    app = typer.Typer()
    register(app)
    for columns in (200, 120, 80):
        out = CliRunner().invoke(app, ["events", str(path)], env={"COLUMNS": str(columns)}).stdout
        assert max(len(line) for line in out.splitlines()) <= columns
        shown = " ".join(out.split())
        if columns >= 120:  # whole, wrapped inside the details column
            assert reason in shown, out
        else:  # 20 columns of details: cut at 48 characters, as before
            assert reason not in shown and "culprits=[7]" in shown and "…" in shown
