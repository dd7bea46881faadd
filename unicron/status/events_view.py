"""`unicron events`: read a run's events.jsonl back, filtered, as a table or JSON lines."""

from __future__ import annotations

import math
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from unicron.errors import InputError, UsageError
from unicron.events import EVENTS_FILE
from unicron.status.fmt import event_details
from unicron.status.render import event_style

_RELATIVE = re.compile(r"^-?\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d)(?:\s+ago)?$", re.IGNORECASE)
_UNIT_S = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
TIME_HELP = "unix seconds, an ISO timestamp (2025-01-31T12:00:00) or a relative time like -5m, -30s, -2h, -1d"
TABLE_ROWS = 500  # rows of each table a long log is printed in
VALUE_LIMIT = 48  # characters of one value in a narrow details column (as the status view's)
VALUE_LINES = 3  # a wide details column shows a value whole up to this many wrapped lines
COLUMN_GAPS = 12  # the table's four gaps between its five columns, 3 characters each


def parse_time(text: str, now: float) -> float:
    """A moment as unix seconds from a user's ``--since``/``--until`` value (pure: ``now`` given).

    Accepts unix seconds, ISO 8601 (naive means local time) and relative ``-5m`` / ``5m ago``.
    """
    value = text.strip()
    match = _RELATIVE.match(value)
    if match and (value.startswith("-") or value.lower().endswith("ago")):
        return now - float(match.group(1)) * _UNIT_S[match.group(2).lower()]
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
        raise UsageError(f"bad time {text!r}: use {TIME_HELP}")  # nan, inf, 1e400 (27C F12)
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise UsageError(f"bad time {text!r}: use {TIME_HELP}") from None
    return moment.timestamp()


def find_events_file(path: str | Path) -> Path:
    """``path`` itself if it is a file; for a directory, the newest events.jsonl below it."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file or directory") from None
    except OSError as err:  # a directory on the way this user may not enter (another user's run)
        raise InputError(f"cannot read {path}: {err.strerror or err}") from None
    if stat.S_ISREG(st.st_mode):
        return p
    if not stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path}: not a file or directory")
    found: list[Path] = []
    unreadable: list[str] = []
    for root, _, files in os.walk(p, onerror=lambda err: unreadable.append(str(err.filename))):
        if EVENTS_FILE in files and os.path.isfile(os.path.join(root, EVENTS_FILE)):
            found.append(Path(root) / EVENTS_FILE)
    if not found:
        why = f" ({len(unreadable)} director{'y' if len(unreadable) == 1 else 'ies'} could not be read, " \
              f"e.g. {unreadable[0]})" if unreadable else ""
        raise InputError(f"no {EVENTS_FILE} under {path}{why}")
    return max(found, key=lambda f: f.stat().st_mtime)


def fmt_clock(ts: Any) -> str:
    """Local wall-clock time with milliseconds (the date too, since a log can span days)."""
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return "-"
    base = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))
    return f"{base}.{int((ts % 1) * 1000):03d}"


def ranks_of(event: Mapping[str, Any]) -> str:
    if event.get("rank") is not None:
        return str(event["rank"])
    ranks = event.get("ranks")
    if isinstance(ranks, list) and ranks:
        return ",".join(str(r) for r in ranks[:8]) + (",…" if len(ranks) > 8 else "")
    return ""


def value_limit(width: int | None, columns: Sequence[int]) -> int:
    """Characters of one detail value in a table ``width`` wide whose other columns take
    ``columns``: VALUE_LINES lines of the details column when that is wider than VALUE_LIMIT,
    so a wide terminal shows a hang decision's culprit analysis whole (a fixed 48 cut it on any
    terminal, 29C F4) and a narrow one keeps its short rows."""
    details = (width or 0) - sum(columns) - COLUMN_GAPS
    return VALUE_LINES * details if details > VALUE_LIMIT else VALUE_LIMIT


def render_events_table(events: Iterable[Mapping[str, Any]], title: str = "", *,
                        widths: Sequence[int | None] = (None, None, None, None), header: bool = True,
                        limit: int = VALUE_LIMIT) -> Table:
    """The events as one table. ``widths``: fixed widths of the time, kind, rank and node
    columns, so the tables of one long log (``event_tables``) line up; ``limit``: characters
    of one detail value (the column folds longer lines)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title=title or None,
                  title_justify="left", title_style="bold", show_header=header)
    time_w, kind_w, rank_w, node_w = widths
    table.add_column("time", no_wrap=True, width=time_w)
    table.add_column("kind", no_wrap=True, width=kind_w)
    table.add_column("rank", justify="right", no_wrap=True, width=rank_w)
    table.add_column("node", no_wrap=True, max_width=16, overflow="ellipsis", width=node_w)
    table.add_column("details", overflow="fold")
    for e in events:
        table.add_row(fmt_clock(e.get("ts")), Text(str(e.get("kind", "?")), style=event_style(e)), ranks_of(e),
                      str(e.get("node", "")),
                      event_details(e, skip=("ts", "kind", "job", "node", "rank", "ranks"), limit=limit))
    return table


def event_tables(events: Sequence[Mapping[str, Any]], title: str = "", rows: int = TABLE_ROWS,
                 width: int | None = None) -> Iterator[Table]:
    """The events as tables of ``rows`` rows each, printed one after another: rich lays a table
    out whole before printing it, which for a log of 100,000 events took minutes and gigabytes
    with nothing shown. Column widths are the whole log's, so the tables read as one.
    ``width``: the console's, which sets how much of a long value is shown (``value_limit``)."""
    widths = (max((len(fmt_clock(e.get("ts"))) for e in events), default=4),
              max((len(str(e.get("kind", "?"))) for e in events), default=4),
              max(4, max((len(ranks_of(e)) for e in events), default=4)),
              min(16, max(4, max((len(str(e.get("node", ""))) for e in events), default=4))))
    for start in range(0, max(len(events), 1), rows):
        yield render_events_table(events[start:start + rows], title if start == 0 else "", widths=widths,
                                  header=start == 0, limit=value_limit(width, widths))
