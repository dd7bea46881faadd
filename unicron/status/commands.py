"""The `unicron status` and `unicron events` commands (registered on the lead's typer app)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.console import Console

from unicron.errors import InputError, UsageError
from unicron.events import read_events
from unicron.status.client import fetch_snapshot, poll_targets, resolve_targets
from unicron.status.events_view import TIME_HELP, event_tables, find_events_file, parse_time
from unicron.status.render import render_runs, render_status
from unicron.status.watch import RunsPoller, SnapshotPoller, run_watch

MAX_WAIT_S = 86400.0  # a day: past it a wait is a typo (and 1e300 overflows the poller)


def print_runs(console: Console, table: Any) -> None:
    """The runs table; into a pipe, as wide as its rows (no terminal width to respect there,
    and a job id or an endpoint folded onto two lines cannot be read back by a script)."""
    if console.is_terminal:
        console.print(table)
        return
    saved = console.width
    console.width = max(saved, console.measure(table, options=console.options.update_width(10_000)).maximum)
    try:
        console.print(table)
    finally:
        console.width = saved


def _console() -> Console:
    # Built per call, so a test runner's redirected stdout is the one written to.
    return Console(file=sys.stdout, highlight=False)


def _dump(obj: Any) -> str:
    return json.dumps(obj, default=str, separators=(",", ":"))


def status(
    endpoint: Annotated[str | None, typer.Option("--endpoint", "-e", metavar="HOST:PORT",
                                                 help="Coordinator to ask (default: the runs on this machine).")] = None,
    job: Annotated[str | None, typer.Option("--job", "-j", metavar="ID", help="Job id (rdzv id) to show.")] = None,
    secret_file: Annotated[str | None, typer.Option("--secret-file", metavar="PATH",
                                                    help="Job secret for --endpoint (default: $UNICRON_SECRET).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one snapshot as JSON and exit.")] = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Keep the view live until the run ends or Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", metavar="S", help="Seconds between polls with --watch.")] = 1.0,
    timeout: Annotated[float, typer.Option("--timeout", metavar="S", help="Seconds to wait for each answer.")] = 3.0,
) -> int:
    """Show what a unicron job is doing: nodes, ranks, restarts, plan and latest events."""
    if not (0 < interval <= MAX_WAIT_S and 0 < timeout <= MAX_WAIT_S):  # NaN fails both (acceptance 21C F6)
        raise UsageError(f"--interval and --timeout must be positive seconds, at most {MAX_WAIT_S:g}")
    if as_json and watch:
        raise UsageError("--json and --watch cannot be combined (use --watch, or poll --json yourself)")
    targets = resolve_targets(endpoint, job, secret_file)
    console = _console()
    # Two runs may share a job id (one --rdzv-id at two endpoints, two one-node jobs of one
    # Slurm allocation): then only the endpoint tells them apart.
    shared_id = len(targets) > 1 and len({t.job for t in targets}) < len(targets)
    pick = "--endpoint HOST:PORT" if shared_id else "--job ID"
    if as_json:
        if len(targets) > 1:
            names = sorted(t.endpoint for t in targets) if shared_id else [t.job for t in targets]
            raise UsageError(f"{len(targets)} runs {f'of job {job!r} ' if job else ''}on this machine: pick one "
                             f"with {pick.split()[0]} ({', '.join(names)})")
        print(_dump(fetch_snapshot(targets[0], timeout)))
        return 0
    if watch:
        poll = SnapshotPoller(targets[0], timeout) if len(targets) == 1 else RunsPoller(
            timeout, targets=lambda: resolve_targets(None, job, None, as_rows=True))
        try:
            ended = run_watch(console, poll, interval)
        except KeyboardInterrupt:
            return 0
        # soft_wrap: a closing line into a file is one line, not cut at 80 columns (29C F5)
        console.print(ended, markup=False, highlight=False, soft_wrap=True)
        return 0
    if len(targets) == 1:
        console.print(render_status(fetch_snapshot(targets[0], timeout), time.time()))
        return 0
    print_runs(console, render_runs(poll_targets(targets, timeout), time.time()))
    console.print(f"pick one with {pick} for the full view", style="dim")
    return 0


def events(
    path: Annotated[str, typer.Argument(metavar="LOGFILE_OR_DIR",
                                        help="An events.jsonl, or a log directory (its newest events.jsonl).")],
    kind: Annotated[list[str] | None, typer.Option("--kind", "-k", metavar="K",
                                                   help="Only this kind (repeat for several).")] = None,
    rank: Annotated[int | None, typer.Option("--rank", "-r", metavar="R", help="Only events about this rank.")] = None,
    since: Annotated[str | None, typer.Option("--since", metavar="T", help=f"Not before T: {TIME_HELP}.")] = None,
    until: Annotated[str | None, typer.Option("--until", metavar="T", help="Not after T (same forms).")] = None,
    last: Annotated[int | None, typer.Option("--last", "-n", metavar="N", help="Only the last N matching events.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON lines instead of a table.")] = False,
) -> int:
    """Read back a run's event log (detections, decisions, transfers, transitions), filtered."""
    now = time.time()
    since_ts = parse_time(since, now) if since is not None else None
    until_ts = parse_time(until, now) if until is not None else None
    if since_ts is not None and until_ts is not None and since_ts > until_ts:
        raise UsageError(f"--since ({since}) is after --until ({until})")
    if last is not None and last <= 0:
        raise UsageError("--last must be positive")
    source = find_events_file(path)
    counts: dict[str, int] = {}
    try:
        found = list(read_events(source, kinds=set(kind) if kind else None, rank=rank, since=since_ts,
                                 until=until_ts, counts=counts))
    except OSError as err:
        raise InputError(f"cannot read {source}: {err.strerror or err}") from None
    if counts["lines"] and not counts["events"]:
        raise InputError(f"{source}: not an event log (none of its {counts['lines']} line(s) is a unicron event)")
    if counts["lines"] > counts["events"]:  # said, on stderr, not passed over in silence (27B F8)
        skipped = counts["lines"] - counts["events"]
        sys.stderr.write(f"unicron: skipped {skipped} line(s) of {source} that are no unicron event (corrupt, or "
                         "written by something else)\n")
    if last is not None:
        found = found[-last:]
    if as_json:
        sys.stdout.write("".join(_dump(e) + "\n" for e in found))
        return 0
    console = _console()
    for table in event_tables(found, title=f"{source} · {len(found)} event{'' if len(found) == 1 else 's'}",
                              width=console.width):
        console.print(table)
    return 0


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("events")(events)
