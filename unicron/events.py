"""Structured event log: one JSON object per line, one file per run.

User output (rich) is separate; this is the record of what unicron saw and decided.
Every line has ``ts`` (unix seconds), ``kind`` and ``job``; the rest depends on the kind
(see docs/status.md for the list of kinds).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
MAX_TS = 1e11  # unix seconds of the year 5138: past any clock, within what time.localtime() takes
MAX_DEPTH = 32  # nesting of an event's JSON; ours go 4 deep


def decision_line(event: Mapping[str, Any]) -> str:
    """A ``decision`` event as the console says it: ``SEV2 restart (culprit rank 1): why``."""
    culprits = event.get("culprits") or []
    blame = f" (culprit rank {', '.join(map(str, culprits))})" if culprits else ""
    reason = str(event.get("reason", "")).splitlines()
    return f"{event.get('severity')} {event.get('action')}{blame}: {reason[0] if reason else ''}"


class EventLog:
    """Append-only JSONL writer, safe to share between threads of one process."""

    def __init__(self, path: str | os.PathLike[str] | None, job: str, node: str = "") -> None:
        self.path = Path(path) if path is not None else None
        self.job = job
        self.node = node
        self._lock = threading.Lock()
        self._fh = None
        self._failed: str | None = None  # why the last write failed (said once): the job goes on
        self.listeners: list[Any] = []  # callables(event_dict), e.g. the status ring buffer
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8", buffering=1)

    def _write(self, line: str) -> None:
        """Append one line. A full or failing disk must not stop the job (the coordinator writes
        here between a stop and its decision): it is said once on stderr, and later writes are
        tried again (a torn line is skipped by readers)."""
        assert self._fh is not None
        try:
            self._fh.write(line + "\n")
        except (OSError, ValueError) as err:
            why = getattr(err, "strerror", None) or str(err)
            if why != self._failed:
                self._failed = why
                try:
                    print(f"unicron: warning: cannot write the event log {self.path}: {why}; events are "
                          "missing from it until it can", file=sys.stderr, flush=True)
                except (OSError, ValueError):
                    pass
            return
        self._failed = None

    def emit(self, kind: str, /, *, ts: float | None = None, **fields: Any) -> dict[str, Any]:
        event: dict[str, Any] = {"ts": time.time() if ts is None else ts, "kind": kind, "job": self.job}
        if self.node:
            event["node"] = self.node
        if "kind" in fields or "ts" in fields:  # a caller bug: never let fields rename the event
            raise ValueError("event fields may not be named 'kind' or 'ts'")
        event.update(fields)
        line = json.dumps(event, default=str, separators=(",", ":"))
        with self._lock:
            if self._fh is not None:
                self._write(line)
            for listener in list(self.listeners):
                try:
                    listener(event)
                except Exception:  # noqa: BLE001 - a listener (a console, the status ring) never stops the emitter
                    pass
        return event

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                try:
                    self._fh.close()
                except OSError:  # its last buffered line could not be written: said when it failed
                    pass
                self._fh = None


def read_events(
    path: str | os.PathLike[str],
    *,
    kinds: set[str] | None = None,
    rank: int | None = None,
    since: float | None = None,
    until: float | None = None,
    counts: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the events of a JSONL file that pass every given filter.

    A line that is not an event (a JSON object with a ``kind`` and a numeric ``ts``; a torn last
    line after a crash) is skipped. ``counts``, if given, gets ``lines`` (complete non-blank
    lines: a torn last line has no newline) and ``events`` (before the filters), so a caller can
    tell a file that holds no events at all.
    """
    counts = counts if counts is not None else {}
    counts.setdefault("lines", 0)
    counts.setdefault("events", 0)
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            # A torn last line is no line; but one that could not even begin an event (binary
            # garbage, no newline anywhere) is counted, so such a file is no event log either.
            counts["lines"] += line.endswith("\n") or not line.lstrip().startswith("{")
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):  # RecursionError: nested deeper than Python parses
                continue
            if not isinstance(event, dict) or not isinstance(event.get("kind"), str):
                continue
            # Nested deeper than any event of ours: parsed, it could not be shown or written back
            # (RecursionError). Counting brackets first keeps the walk off ordinary lines.
            if line.count("[") + line.count("{") > MAX_DEPTH and _deeper_than(event, MAX_DEPTH):
                continue
            ts = event.get("ts")
            # A time no clock of ours wrote (NaN, 1e300, before 1970) is no event: it cannot be shown.
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < MAX_TS:
                continue
            counts["events"] += 1
            if kinds is not None and event.get("kind") not in kinds:
                continue
            ranks = event.get("ranks")
            if rank is not None and event.get("rank") != rank and not (isinstance(ranks, list) and rank in ranks):
                continue
            if since is not None and ts < since:
                continue
            if until is not None and ts > until:
                continue
            yield event


def _deeper_than(obj: Any, limit: int) -> bool:
    """Whether ``obj`` (parsed JSON) nests more than ``limit`` lists and dicts in one another."""
    level: list[Any] = [obj]
    for depth in range(1, limit + 2):
        containers = [x for x in level if isinstance(x, list | dict)]
        if not containers:
            return False
        if depth > limit:
            return True
        level = [v for x in containers for v in (x.values() if isinstance(x, dict) else x)]
    return False
