"""`unicron status --watch`: poll a coordinator and keep the view live through failures.

A poll gives a ``Frame``: the full view (for a terminal), one line (for a pipe or file) and,
once the run is over, why. ``run_watch`` draws frames until one says the run ended. The
coordinator may not answer for a while during a transition; the view then says
"reconnecting…" over the last snapshot it had and keeps polling. One that does not answer the
first poll is an error, as without ``--watch``, unless it is a run on this machine whose process
lives (starting on a loaded machine): that one is waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.text import Text

from unicron.errors import EndpointUnreachableError
from unicron.status.client import (
    RunRow,
    Target,
    WatchState,
    fetch_snapshot,
    how_it_ended,
    job_state,
    poll_targets,
    resolve_targets,
)
from unicron.status.fmt import fmt_duration
from unicron.status.render import render_runs, render_status
from unicron.status.statusline import format_status_line, line_signature
from unicron.textclip import printable


def one_line(text: str) -> str:
    """``text`` as one line: a job's reason may be a worker's whole traceback, and a log of
    `--watch` promises one line per change (29C F5). Control characters are shown, not obeyed."""
    return printable(" ".join(text.split()))


@dataclass(frozen=True)
class Frame:
    view: RenderableType
    line: str
    ended: str = ""
    key: tuple[Any, ...] = ()  # a plain-mode line is printed when this changes (or now and then)


def reconnect_banner(state: WatchState, endpoint: str, now: float) -> Text:
    since = fmt_duration(now - state.failing_since) if state.failing_since is not None else "0s"
    text = Text(f"reconnecting to {endpoint}… (no answer for {since}; showing the last snapshot)",
                style="bold yellow")
    if state.error:
        text.append(f"\n{state.error}", style="dim")
    return text


def frame_for(state: WatchState, target: Target, now: float) -> Frame:
    """What to show for ``state`` (pure)."""
    if state.ended:
        banner: Text | None = Text(state.ended, style="bold blue")
    elif state.snapshot is None:  # a run on this machine not answering yet: nothing to reconnect to
        since = fmt_duration(now - state.failing_since) if state.failing_since is not None else "0s"
        banner = Text(f"waiting for {target.endpoint}… (no answer for {since})", style="dim")
    elif state.reconnecting:
        banner = reconnect_banner(state, target.endpoint, now)
    else:
        banner = None
    if state.snapshot is None:
        waiting = banner or Text(f"waiting for {target.endpoint}…", style="dim")
        view: RenderableType = Panel(waiting, title=f"unicron status · {target.job}", title_align="left")
        line = waiting.plain.splitlines()[0]
    else:
        view = render_status(state.snapshot, now, banner=banner)
        line = format_status_line(state.snapshot, now)
        if state.reconnecting:
            line = f"reconnecting to {target.endpoint}… (last: {line})"
    if state.ended:
        line = state.ended
    signature = line_signature(state.snapshot) if state.snapshot is not None else ()
    return Frame(view, line, state.ended, key=(signature, state.reconnecting))


class SnapshotPoller:
    """Poll one target; each call returns the Frame to show now."""

    def __init__(self, target: Target, timeout_s: float, *, clock: Callable[[], float] = time.time,
                 fetch: Callable[[Target, float], dict] = fetch_snapshot) -> None:
        self.target, self.timeout_s, self.clock, self.fetch = target, timeout_s, clock, fetch
        self.state = WatchState()

    def __call__(self) -> Frame:
        try:
            snapshot = self.fetch(self.target, self.timeout_s)
        except EndpointUnreachableError as err:
            gone = self.target.gone()
            # Never reached: the same one error as without --watch, not an endless wait; unless
            # it is a run on this machine whose process lives (busy starting, on a loaded machine).
            alive = self.target.pid is not None and not gone
            if self.state.snapshot is None and not self.state.ended and not alive:
                raise
            self.state.on_error(str(err), self.clock(), run_gone=gone,
                                job_end=self.target.final_event() if gone else None)
        else:
            self.state.on_snapshot(snapshot, self.clock())
        return frame_for(self.state, self.target, self.clock())


class RunsPoller:
    """Poll every run on this machine (the list is read again each time); ends when none is left.
    A run that leaves the list (its launcher exited, or died) stays as a row saying how it
    ended, from the ``job_end`` of its event log or else the last state seen: a monitor reading
    the lines must not see a failed job just vanish."""

    def __init__(self, timeout_s: float, *, clock: Callable[[], float] = time.time,
                 targets: Callable[[], list[Target]] | None = None,
                 poll: Callable[[list[Target], float], list[RunRow]] = poll_targets) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        # Rows, always: the one run left may be one whose secret cannot be read (a row saying so).
        self.targets = targets or (lambda: resolve_targets(None, None, None, as_rows=True))
        self.poll = poll
        self.live: dict[tuple[str, int | None], Target] = {}
        self.last_state: dict[tuple[str, int | None], str] = {}
        self.ended: dict[tuple[str, int | None], tuple[dict[str, Any], str]] = {}

    def __call__(self) -> Frame:
        try:
            targets = self.targets()
        except EndpointUnreachableError:
            targets = []
        now_live = {(t.job, t.pid): t for t in targets}
        for key, target in self.live.items():
            if key not in now_live and key not in self.ended:
                self.ended[key] = (target.info(), self._how_it_ended(target, key))
        self.live = now_live
        rows = self.poll(targets, self.timeout_s) if targets else []
        for info, snap, _ in rows:
            if snap is not None:
                self.last_state[(info["job"], info["pid"])] = job_state(snap)
        rows += [(info, None, text) for info, text in self.ended.values()]
        now = self.clock()
        line = "; ".join(f"{info['job']}: {(error or 'no answer') if snap is None else format_status_line(snap, now)}"
                         for info, snap, error in rows)
        signature = tuple((info["job"], error if snap is None else line_signature(snap)) for info, snap, error in rows)
        if not targets:
            done = "every unicron run on this machine ended"
            if not rows:
                return Frame(Text("no unicron run left on this machine"), "no unicron run left on this machine",
                             ended=done)
            return Frame(render_runs(rows, now), line, ended=f"{line}; {done}", key=signature)
        hint = Text("pick one with --job ID for the full view", style="dim")
        return Frame(Group(render_runs(rows, now), hint), line, key=signature)

    def _how_it_ended(self, target: Target, key: tuple[str, int | None]) -> str:
        end = target.final_event()
        if end is not None:
            return f"ended ({how_it_ended(end)})"
        return f"ended (its coordinator is gone; last state: {self.last_state.get(key, 'unknown')})"


def run_watch(console: Console, poll: Callable[[], Frame], interval_s: float, *,
              wait: Callable[[float], object] = time.sleep, clock: Callable[[], float] = time.monotonic,
              plain_every_s: float = 30.0) -> str:
    """Draw frames until the run ends; return why it ended. Ctrl-C propagates to the caller.

    A terminal gets the full live view; anything else gets one line (never wrapped, newlines
    collapsed) when something that matters changes (state, attempt, restarts, rank states, reachability) and otherwise every
    ``plain_every_s``, so a log of `--watch` stays readable.
    """
    if console.is_terminal and not console.is_dumb_terminal:
        with Live(console=console, auto_refresh=False, transient=False, redirect_stdout=False,
                  redirect_stderr=False) as live:
            while True:
                frame = poll()
                live.update(frame.view, refresh=True)
                if frame.ended:
                    return frame.ended
                wait(interval_s)
    last: tuple[float, tuple[Any, ...]] | None = None
    while True:
        frame = poll()
        if frame.ended:
            return one_line(frame.ended)  # printed by the caller with soft_wrap: never wrapped
        now = clock()
        if last is None or frame.key != last[1] or now - last[0] >= plain_every_s:
            console.print(one_line(frame.line), markup=False, highlight=False, soft_wrap=True)
            last = (now, frame.key)
        wait(interval_s)
