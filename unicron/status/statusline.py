"""The one-line live status `unicron run` shows in a terminal (plain lines in a pipe or file).

``format_status_line`` / ``status_line_text`` are pure. ``StatusLine`` is the thin shell the
launcher drives: ``update(snapshot)`` whenever it has a fresh snapshot, ``event(text)`` for
things the user must see (a failure, a restart), ``close()`` at the end.

Modes (``--status-line``): ``auto`` shows a live line when the console is a terminal and plain
lines otherwise; ``always`` forces the live line; ``never`` shows no status, only events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.text import Text

from unicron.errors import UsageError
from unicron.status.fmt import fmt_iter_time, num, plausible, short_value
from unicron.status.render import JOB_STATE_STYLE, job_of, min_step, steps_per_second, uptime, workers_of

MODES = ("auto", "always", "never")
PREFIX = "unicron: "


def _cause(snapshot: Mapping[str, Any]) -> str:
    """Why the job is not running, for a restarting or waiting job ("" if unknown)."""
    plan = snapshot.get("plan")
    if isinstance(plan, dict) and plan.get("transition"):
        return str(plan["transition"])
    restarts = snapshot.get("restarts")
    if isinstance(restarts, list) and restarts and isinstance(restarts[-1], dict):
        return str(restarts[-1].get("cause", ""))
    return ""


def status_line_text(snapshot: Mapping[str, Any], now: float) -> Text:
    """The compact status, styled: job, state, attempt, restarts, ranks, step, speed, uptime."""
    snapshot = plausible(snapshot)
    job = job_of(snapshot)
    state = str(job.get("state", ""))
    text = Text()
    # A launcher may pass a partial snapshot (only its own node's workers): show what is there.
    if job.get("id") is not None:
        text.append(str(job["id"]), style="bold")
    if state:
        text.append(" " if text else "")
        text.append(state, style=JOB_STATE_STYLE.get(state, ""))
    if state in ("restarting", "waiting") and job.get("attempt") and (cause := _cause(snapshot)):
        text.append(f" ({short_value(cause, 60)})", style="yellow")
    if state in ("done", "failed") and job.get("exit_code") is not None:
        text.append(f" exit {job['exit_code']}")
    workers = [w for _, w in workers_of(snapshot)]
    by_state: dict[str, int] = {}
    for w in workers:
        by_state[str(w.get("state", "?"))] = by_state.get(str(w.get("state", "?")), 0) + 1
    parts: list[tuple[str, str]] = []
    if job.get("attempt") is not None:
        parts.append((f"attempt {job['attempt']}", ""))
    if num(job.get("restarts")):
        parts.append((f"restarts {job['restarts']}/{job.get('max_restarts', '-')}", "yellow"))
    if workers:
        label = f"ranks {by_state.get('running', 0)}/{job.get('world_size') or len(workers)} running"
        bad = [f"{by_state[s]} {s}" for s in ("hung", "failed") if by_state.get(s)]
        parts.append((label + (f" ({', '.join(bad)})" if bad else ""), "bold red" if bad else ""))
    step = min_step(snapshot)
    if step is not None:
        parts.append((f"step {step}", "bold"))
    sps = steps_per_second(snapshot)
    if sps:
        parts.append((f"{fmt_iter_time(1.0 / sps)}/it {sps:.3g} it/s", ""))
    if num(job.get("started_at")):
        parts.append((f"up {uptime(job, now)}", "dim"))  # stops at an ended job's end
    for label, style in parts:
        if text:
            text.append(" · ", style="dim")
        text.append(label, style=style)
    return text if text else Text("starting…", style="dim")


def format_status_line(snapshot: Mapping[str, Any], now: float) -> str:
    return status_line_text(snapshot, now).plain


def line_signature(snapshot: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must change for a plain-mode line to be printed before its interval is up."""
    job = job_of(snapshot)
    states = tuple(sorted(str(w.get("state")) for _, w in workers_of(snapshot)))
    return job.get("state"), job.get("attempt"), job.get("restarts"), states


class StatusLine:
    """Live one-line status (terminal) or plain progress lines (pipe/file); see module doc."""

    def __init__(self, console: Console | None = None, mode: str = "auto", *,
                 clock: Callable[[], float] = time.time, plain_every_s: float = 30.0) -> None:
        if mode not in MODES:
            raise UsageError(f"--status-line must be one of {', '.join(MODES)}, not {mode!r}")
        console = console or Console()
        terminal = console.is_terminal and not console.is_dumb_terminal
        self.mode = mode
        self.live_mode = mode == "always" or (mode == "auto" and terminal)
        if self.live_mode and not terminal:  # "always": draw the live line even where rich sees no TTY
            console = Console(file=console.file, force_terminal=True, width=console.width)
        self.console = console
        self.clock = clock
        self.plain_every_s = plain_every_s
        self._snapshot: Mapping[str, Any] | None = None
        self._last_plain: tuple[float, tuple[Any, ...]] | None = None
        self._lock = threading.Lock()
        self._live: Live | None = None
        if self.live_mode:
            # Redirecting stdout/stderr puts prints of this process above the line, not through it.
            self._live = Live(get_renderable=self._render, console=console, auto_refresh=True,
                              refresh_per_second=2, transient=False, redirect_stdout=True, redirect_stderr=True)
            self._live.start()

    def _render(self) -> Text:
        snapshot = self._snapshot
        if snapshot is None:
            return Text(PREFIX + "starting…", style="dim")
        text = status_line_text(snapshot, self.clock())
        text.no_wrap, text.overflow = True, "ellipsis"
        return text

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Show a fresh snapshot (live: redraw; plain: print when it changed or every plain_every_s)."""
        with self._lock:
            self._snapshot = snapshot
            if self._live is not None:
                self._live.refresh()
                return
            if self.mode == "never":
                return
            now, signature = self.clock(), line_signature(snapshot)
            last = self._last_plain
            if last is not None and last[1] == signature and now - last[0] < self.plain_every_s:
                return
            self._last_plain = (now, signature)
            self._print_plain(PREFIX + format_status_line(snapshot, now))

    def event(self, text: str) -> None:
        """A line the user must see (printed above the live line, or as a plain line)."""
        with self._lock:
            if self._live is not None:
                line = Text(PREFIX, style="bold cyan")
                line.append(text)
                self.console.print(line, soft_wrap=True)
            else:
                self._print_plain(PREFIX + text)

    def _print_plain(self, line: str) -> None:
        self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Stop the live line and take it off the screen: its last state was drawn while the job
        ran ("running"), and the lines printed above it say how the job ended. Safe to call twice."""
        with self._lock:
            live, self._live = self._live, None
        if live is not None:
            live.transient = True
            live.stop()

    def __enter__(self) -> StatusLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
