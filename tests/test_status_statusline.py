"""`unicron run`'s status line: the pure one-liner, plain lines in a pipe, a live line in a terminal."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from unicron.errors import UsageError
from unicron.status.samples import failing_snapshot, healed_snapshot
from unicron.status.statusline import StatusLine, format_status_line

NOW = 1_750_000_000.0
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_format_running() -> None:
    line = format_status_line(healed_snapshot(NOW), NOW)
    assert line == (
        "gpt-demo running · attempt 1 · restarts 1/3 · ranks 4/4 running · step 812 · 52ms/it 19 it/s · up 5m12s"
    )


def test_format_failure_names_the_cause_and_bad_ranks() -> None:
    line = format_status_line(failing_snapshot(NOW), NOW)
    assert line.startswith("gpt-demo restarting (node_lost on node trn-b")
    assert "ranks 1/4 running (1 hung, 2 failed)" in line
    assert "restarts 2/3" in line


def test_format_done_and_empty() -> None:
    snap = healed_snapshot(NOW)
    snap["job"].update(state="done", exit_code=0)
    assert format_status_line(snap, NOW).startswith("gpt-demo done exit 0 · attempt 1")
    assert format_status_line({}, NOW) == "starting…"
    partial = {"nodes": [{"workers": [{"rank": 0, "state": "running", "step": 7, "iter_times": [0.5]},
                                      {"rank": 1, "state": "failed", "step": 6}]}]}
    assert format_status_line(partial, NOW) == "ranks 1/2 running (1 failed) · step 6 · 500ms/it 2 it/s"


def test_plain_mode_prints_changes_and_then_every_interval() -> None:
    out = io.StringIO()
    clock = FakeClock(NOW)
    line = StatusLine(Console(file=out, width=200), "auto", clock=clock, plain_every_s=30)
    assert not line.live_mode  # a StringIO is not a terminal
    snap = healed_snapshot(NOW)
    line.update(snap)
    clock.t += 1
    line.update(snap)  # nothing changed, interval not up: no line
    line.event("rank 1 exited with SIGKILL; restarting")
    line.update(failing_snapshot(NOW))  # state changed: a line at once
    clock.t += 31
    line.update(failing_snapshot(NOW))  # unchanged, but the interval is up
    line.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("unicron: gpt-demo running")
    assert lines[1] == "unicron: rank 1 exited with SIGKILL; restarting"
    assert lines[2].startswith("unicron: gpt-demo restarting") and lines[2].endswith("up 5m13s")
    assert lines[3].startswith("unicron: gpt-demo restarting") and lines[3].endswith("up 5m44s")
    assert "\x1b" not in out.getvalue()  # no terminal codes in a pipe


def test_never_mode_prints_only_events() -> None:
    out = io.StringIO()
    line = StatusLine(Console(file=out), "never")
    line.update(healed_snapshot(NOW))
    line.event("job done")
    line.close()
    assert out.getvalue() == "unicron: job done\n"


def test_live_mode_draws_and_updates_one_line() -> None:
    out = io.StringIO()
    console = Console(file=out, width=150, force_terminal=True, color_system="standard")
    line = StatusLine(console, "auto", clock=FakeClock(NOW))
    assert line.live_mode
    line.update(healed_snapshot(NOW))
    line.event("rank 1 exited")
    line.update(failing_snapshot(NOW))
    line.close()
    line.close()  # idempotent
    raw = out.getvalue()
    assert "\x1b[" in raw  # drawn with cursor control, not appended lines
    assert "gpt-demo" in raw and "restarting" in raw and "rank 1 exited" in raw
    # Closed, the line is erased: its last state ("restarting", "running") would outlive the job.
    assert raw.endswith("\x1b[1A\x1b[2K"), repr(raw[-80:])


def test_always_forces_the_live_line_outside_a_terminal() -> None:
    out = io.StringIO()
    line = StatusLine(Console(file=out, width=120), "always", clock=FakeClock(NOW))
    assert line.live_mode
    line.update(healed_snapshot(NOW))
    line.close()
    assert "\x1b[" in out.getvalue() and "gpt-demo running" in ANSI.sub("", out.getvalue())


def test_bad_mode_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="--status-line must be one of auto, always, never"):
        StatusLine(Console(file=io.StringIO()), "sometimes")
