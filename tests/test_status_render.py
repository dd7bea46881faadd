"""The status view, rendered with rich's recording console from sample snapshots."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from unicron.status.fmt import event_details, fmt_age, fmt_bytes, fmt_duration, fmt_iter_time, sparkline
from unicron.status.render import min_step, render_runs, render_status, steps_per_second
from unicron.status.samples import failing_snapshot, healed_snapshot
from unicron.status.statusline import format_status_line

NOW = 1_750_000_000.0


def capture(renderable: object, width: int = 110) -> str:
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    return console.export_text()


def test_healed_run_shows_nodes_ranks_restart_and_events() -> None:
    text = capture(render_status(healed_snapshot(NOW), NOW))
    assert "gpt-demo" in text and "running" in text
    assert "restarts 1/3" in text and "attempt 1" in text
    assert "step 812" in text
    for host in ("trn-a", "trn-b"):
        assert host in text
    # one row per rank, with its pid and step
    for pid in (48211, 48377, 30112, 30113):
        assert str(pid) in text
    assert "SEV2" in text and "killed by SIGKILL" in text  # the restart and its cause
    assert "fault_kind=exit" in text and "attempt_start" in text  # latest events
    assert "2× 96% 122G/160G" in text  # GPU health summary
    assert any(ch in text for ch in "▁▂▃▄▅▆▇█")  # iteration-time sparkline


def test_failure_is_visible() -> None:
    text = capture(render_status(failing_snapshot(NOW), NOW))
    assert "restarting" in text
    assert "lost" in text and "Xid 79" in text
    assert "hung" in text and text.count("failed") >= 2
    assert "SEV1" in text and "reconfigure" in text and "no heartbeat" in text
    assert "transition: node_lost on node trn-b" in text
    assert "node_lost" in text
    assert "dropped msgs 2" in text
    assert "not judged" not in text
    snap = failing_snapshot(NOW)
    snap["job"]["silence_excused"] = True
    assert "silent nodes not judged: the coordinator's own link is suspect" in capture(render_status(snap, NOW), 200)


def test_view_is_compact_and_fits_the_width() -> None:
    for width in (80, 110, 160):
        text = capture(render_status(failing_snapshot(NOW), NOW), width)
        lines = text.splitlines()
        assert max(len(line) for line in lines) <= width
        assert len(lines) <= 40  # 2 nodes, 4 ranks, 2 restarts, 6 events fit one screen
        assert "" not in (line.strip("│ ") for line in lines[1:-1]), "no empty lines inside the panel"


def test_styles_mark_bad_states() -> None:
    console = Console(
        record=True, width=120, file=io.StringIO(), force_terminal=True, color_system="truecolor"
    )
    console.print(render_status(failing_snapshot(NOW), NOW))
    html = console.export_html(inline_styles=True)
    # "failed" and "lost" are drawn in red, "hung" in magenta
    assert "color: #800000" in html or "color: #ff0000" in html
    assert "#800080" in html or "#ff00ff" in html


def test_ended_job_says_why() -> None:
    snap = healed_snapshot(NOW)
    snap["job"].update(state="failed", exit_code=1, reason="restart budget spent: 3 of 3")
    text = capture(render_status(snap, NOW))
    assert "ended: exit 1" in text and "restart budget spent" in text


def test_garbage_snapshot_renders_without_raising() -> None:
    for snap in (
        {},
        {"job": None, "nodes": "x"},
        {
            "job": {"state": 3},
            "nodes": [{"workers": [{"rank": "a"}, 5]}, 7],
            "restarts": [None, {"ts": "x"}],
            "events": [1, {"kind": None}],
            "plan": [],
        },
    ):
        text = capture(render_status(snap, NOW))
        assert "unicron status" in text
        assert format_status_line(snap, NOW)


def _every_number(value: object, extreme: float | int) -> object:
    if isinstance(value, dict):
        return {k: _every_number(v, extreme) for k, v in value.items()}
    if isinstance(value, list):
        return [_every_number(v, extreme) for v in value]
    return extreme if type(value) in (int, float) else value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extreme", [1e308, -1e308, float("inf"), float("-inf"), float("nan"), 10**400, -(10**400)])
def test_any_number_a_coordinator_sends_renders_without_raising(extreme: float | int) -> None:
    """Acceptance 29C F3: iteration times of 1e308 and -1e308 overflowed the sparkline's range
    (inf / inf, then int(NaN)) and `unicron status` was an internal error; int(inf) did the same
    for a step, and a 300-digit duration filled the line."""
    for base in (healed_snapshot(NOW), failing_snapshot(NOW)):
        snap = _every_number(base, extreme)
        snap["nodes"][0]["workers"][0]["iter_times"] = [1e308, -1e308, 0, extreme, 1.5]
        text = capture(render_status(snap, NOW))
        assert "unicron status" in text and "gpt-demo" in text
        assert format_status_line(snap, NOW)
        assert len(max(text.splitlines(), key=len)) <= 110
    # Past 1e18 nothing a coordinator sends is a number (30B F6: a 309-digit node count pushed
    # the nodes table's columns out); what is left is drawn.
    assert sparkline([1e308, -1e308, 0, 1]) == "▁█"
    assert not re.search(r"\d{19}", text), text
    assert sparkline([float("nan"), float("inf"), 1, 2]) == "▁█"
    assert fmt_duration(1e308) == "1.16e+303d"


def test_json_round_trip_keeps_the_documented_shape() -> None:
    snap = json.loads(json.dumps(healed_snapshot(NOW)))
    workers = [w for node in snap["nodes"] for w in node["workers"]]
    assert [w["rank"] for w in workers] == [0, 1, 2, 3]
    assert all(isinstance(w["step"], int) and isinstance(w["rank"], int) for w in workers)
    assert capture(render_status(snap, NOW)) == capture(render_status(healed_snapshot(NOW), NOW))


def test_progress_is_the_slowest_rank() -> None:
    snap = healed_snapshot(NOW)
    snap["nodes"][1]["workers"][1]["step"] = 800
    snap["nodes"][1]["workers"][1]["iter_times"] = [0.1, 0.1, 0.1]
    assert min_step(snap) == 800
    assert steps_per_second(snap) == 10.0
    assert min_step({}) is None and steps_per_second({}) is None


def test_formatters() -> None:
    assert fmt_duration(0.42) == "0.4s"
    assert fmt_duration(75) == "1m15s"
    assert fmt_duration(2 * 3600 + 600) == "2h10m"
    assert fmt_duration(3 * 86400 + 4 * 3600) == "3d04h"
    assert fmt_age(0, NOW) == "-" and fmt_age(None, NOW) == "-" and fmt_age(NOW - 12, NOW) == "12s"
    assert fmt_iter_time(0.052) == "52ms" and fmt_iter_time(1.5) == "1.50s" and fmt_iter_time(None) == "-"
    assert fmt_bytes(80 * 1024**3) == "80G" and fmt_bytes(512) == "512B" and fmt_bytes(1536) == "1.5K"
    assert event_details({"ts": 1, "kind": "k", "job": "j", "rank": 2, "msg": "a\nb"}) == "rank=2 msg=a b"
    # a time of day is shown as its offset from the event's own time, not as 1.797e+09
    fault = {"ts": 1796567160.209, "kind": "fault", "job": "j", "occurred_at": 1796567155.009, "latency_s": 0.01}
    assert "occurred_at=-5.200s" in event_details(fault) and "latency_s=0.01" in event_details(fault)
    assert "occurred_at=5" in event_details({"ts": 9.0, "kind": "k", "job": "j", "occurred_at": 5.0})


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert sparkline([]) == ""
    assert len(set(sparkline([0.05] * 5))) == 1
    assert len(sparkline(range(100))) == 12  # only the most recent values
    assert sparkline([1, None, "x", 3]) == "▁█"


def test_runs_table_shows_unreachable_runs() -> None:
    rows = [
        ({"job": "a", "endpoint": "h:1", "started_at": NOW - 5}, healed_snapshot(NOW), ""),
        ({"job": "b", "endpoint": "h:2", "started_at": NOW - 9}, None, "no answer"),
    ]
    text = capture(render_runs(rows, NOW))
    assert "2 unicron runs" in text
    assert "gpt-demo" not in text.split("\n")[0]
    assert "no answer" in text and "812" in text and "1/3" in text


def test_runs_table_into_a_pipe_keeps_ids_and_endpoints_on_one_line() -> None:
    """``unicron status | awk``: a uuid job id and an endpoint folded onto two lines cannot be
    read back; a pipe has no width to respect."""
    from unicron.status.commands import print_runs

    job = "7ddb2a69-53c6-4acd-bbf8-2aa81b32552b"
    rows = [({"job": job, "endpoint": "127.0.0.1:37893", "started_at": NOW - 5}, healed_snapshot(NOW), "")]
    out = io.StringIO()
    print_runs(Console(width=80, file=out, color_system=None), render_runs(rows, NOW))
    row = next(line for line in out.getvalue().splitlines() if job in line)
    assert "127.0.0.1:37893" in row, out.getvalue()


def test_nodes_show_what_their_ranks_do_between_steps() -> None:
    snapshot = healed_snapshot(NOW)
    snapshot["nodes"][0]["activity"] = "working"
    snapshot["nodes"][1]["activity"] = "idle"
    text = capture(render_status(snapshot, NOW), width=140)
    assert "activity" in text and "working" in text
    line_b = next(line for line in text.splitlines() if "trn-b" in line and "%" in line)
    assert "idle" not in line_b, "idle (the normal state while steps flow) is shown as '-'"


def test_a_waiting_job_shows_no_rate_and_a_node_without_a_place_no_rank() -> None:
    snapshot = healed_snapshot(NOW)
    assert "it/s" in capture(render_status(snapshot, NOW), width=140)
    snapshot["job"]["state"] = "waiting"
    snapshot["nodes"][1]["node_rank"] = -1  # joined, no place in an attempt yet
    text = capture(render_status(snapshot, NOW), width=140)
    assert "it/s" not in text.splitlines()[1] and "waiting" in text
    line_b = next(line for line in text.splitlines() if "trn-b" in line and "%" in line)
    assert line_b.strip("│ ").split()[0] == "-", line_b


def test_a_workers_terminal_escapes_are_shown_not_obeyed() -> None:
    """An exception message with escapes (clear screen, set title, colour) in the restarts table
    and the events: ``unicron status`` in a terminal must not clear or retitle it."""
    snapshot = healed_snapshot(NOW)
    evil = "bad \x1b[31mRED\x1b[0m \x1b]0;pwned\x07 \x1b[2J cleared\x00"
    snapshot["events"].append({"ts": NOW - 1, "kind": "fault", "job": "gpt-demo", "rank": 1, "message": evil})
    snapshot["restarts"][0]["cause"] = evil
    text = capture(render_status(snapshot, NOW), width=200)
    assert "\x1b" not in text and "\x00" not in text and "\x07" not in text
    assert "\\x1b[31mRED" in text


def test_a_reply_cut_to_the_message_limit_says_what_it_left_out() -> None:
    """A big job's reply leaves out iteration times, then nodes (unicron.coord.statusfit): the
    view says how many nodes it does not show, rather than passing the shown ones for the job."""
    snapshot = healed_snapshot(NOW)
    snapshot["job"].update(world_size=10_000, nodes_not_shown=1248, iter_times_not_shown=True)
    for node in snapshot["nodes"]:
        for worker in node["workers"]:
            worker.pop("iter_times")
    text = capture(render_status(snapshot, NOW), width=140)
    assert "1248 more nodes not shown" in text and "ranks of 1248 more nodes not shown" in text
    assert "no trend: iteration times not sent" in text
    whole = capture(render_status(healed_snapshot(NOW), NOW), width=140)
    assert "not shown" not in whole and "no trend" not in whole
    runs = capture(render_runs([({"job": "big", "endpoint": "h:1", "started_at": NOW - 5}, snapshot, "")], NOW))
    assert "10000" in runs  # the job's ranks, not the few shown


@pytest.mark.timeout(30)
def test_an_ended_jobs_up_time_stops_at_its_end() -> None:
    """Acceptance 29C F7 (the view's side; the coordinator's in test_coord_core)."""
    from unicron.status.render import uptime

    snap = healed_snapshot(NOW)
    snap["job"].update(state="failed", started_at=NOW - 600, ended_at=NOW - 480)
    assert "up 2m00s" in capture(render_status(snap, NOW + 86_400))
    rows = [({"job": "gpt-demo", "endpoint": "h:1", "started_at": NOW - 900}, snap, "")]
    assert "2m00s" in capture(render_runs(rows, NOW + 86_400))
    assert uptime({"started_at": NOW - 60, "ended_at": None}, NOW) == "1m00s"  # running: up to now
    assert uptime({"started_at": NOW - 60, "ended_at": NOW - 120}, NOW) == "1m00s"  # an end before the start: now
    assert uptime({"ended_at": NOW - 60}, NOW, NOW - 120) == "1m00s"  # the registry's start
