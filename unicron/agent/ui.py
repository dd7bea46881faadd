"""What the agent tells the user on the terminal (separate from the JSONL event log).

In a terminal: rich-styled lines plus a compact live status line; in a pipe or file: plain
lines, one per event, nothing redrawn.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.text import Text

from unicron.consoleline import line_start
from unicron.events import decision_line
from unicron.textclip import clip_line, first_line, printable, with_type

# C0 and C1 control characters but tab and newline, and DEL: a worker's exception message can
# hold NULs or terminal escapes, which must not recolour or rewrite the user's terminal through
# our lines.


class AgentUI:
    def __init__(self, mode: str = "auto", *, name: str = "unicron", label: str = "",
                 workers_off_console: bool = False) -> None:
        # ``name`` and ``label`` (e.g. "job 'x': ") say who speaks: a standalone coordinator
        # tells several jobs' decisions on one console.
        self.name, self.label = name, label
        self.console_gone = False  # a write to it failed: nothing more is written there
        self.console = Console(file=sys.stderr, highlight=False, soft_wrap=True)
        # The workers write to the terminal themselves (as under torchrun), past any line drawn
        # in place: ``auto`` draws the live line only where none of their output reaches it.
        self.live = mode == "always" or (mode == "auto" and self.console.is_terminal and workers_off_console)
        self.quiet_status = mode == "never"
        self._line: Any = None
        self.job: dict[str, Any] = {}  # the live line's job fields known from the start (id, max_restarts, started_at)
        if self.live:
            try:
                from unicron.status.statusline import StatusLine

                self._line = StatusLine(self.console, "always")
            except Exception:  # the status line is a nicety; never fail a job for it
                self._line = None

    def info(self, text: str) -> None:
        self._print("bold cyan", printable(self.label + text))

    def warn(self, text: str) -> None:
        self._print("bold yellow", printable(self.label + text))

    def _print(self, style: str, plain: str) -> None:
        if self.console_gone:
            return
        if self._line is not None:
            try:
                self._line.event(plain)
                return
            except Exception:
                self._line = None
        try:
            if self.console.is_terminal:
                line = Text(line_start() + self.name, style=style)  # a Text: a worker's "[/tmp/x]" is not markup
                line.append(f": {plain}")
                self.console.print(line)
            else:
                sys.stderr.write(f"{line_start()}{self.name}: {time.strftime('%H:%M:%S')} {plain}\n")
                sys.stderr.flush()
        except (OSError, ValueError):
            # The console is gone (`| head` exited: EPIPE; the terminal closed: EIO). That costs
            # its lines, not the job: the event log keeps everything.
            self.console_gone = True

    def on_event(self, event: dict[str, Any]) -> None:
        """Show the coordinator's decisions as they happen (the JSONL log has the details)."""
        kind = event.get("kind")
        if kind == "decision":
            self.warn(decision_line(event))
        elif kind == "join_refused":
            say = self.info if event.get("waits") else self.warn
            say(f"node {event.get('node_id') or event.get('host')} refused: {event.get('reason')}")
        elif kind == "join_note":
            self.warn(str(event.get("note")))
        elif kind == "node_lost":
            self.warn(f"node {event.get('node_id') or event.get('host')} lost: {event.get('reason') or 'no heartbeat'}")
        elif kind == "coordinator_deaf":
            who = "none of the other nodes" if event.get("own_nodes") else "no node of any job"
            self.warn(f"heard {who} for {event.get('silent_s', 0):.1f} s, and their hosts do not answer: "
                      f"taking the silence for this coordinator's own (its network?), not the nodes'; "
                      f"nobody is judged by it for up to {event.get('cap_s', 0):g} s")
        elif kind == "coordinator_hears_again":
            how = "a silent node's host answers again" if event.get("by") == "probe" else "hears its nodes again"
            more = (f", and up to {event['grace_s']:.1f} s more for those still silent (their connections "
                    f"retransmit)") if event.get("grace_s") else ""
            self.info(f"{how}; {event.get('excused_s', 0):.1f} s of silence not counted against them{more}")
        elif kind == "job_resumed":  # a standalone coordinator's own console, after it restarted
            self.info(f"took back attempt {event.get('attempt')} ({event.get('nnodes')} node(s), "
                      f"{event.get('restarts_used')} restart(s) spent) from its agents")
        elif kind == "store_reopened":  # the same console: the ranks had not used their store yet
            self.info(f"opened the workers' store of attempt {event.get('attempt')} again on port "
                      f"{event.get('port')}: no rank had called init_process_group")
        elif kind == "waiting_for_nodes":
            missing = int(event.get("need", 0)) - int(event.get("have", 0))
            if event.get("gone"):  # before the first attempt: the job is still forming
                self.warn(f"{event['gone']} before the job started; waiting for {missing} more node(s) "
                          f"(--nnodes needs {event.get('need')}), up to the join timeout "
                          f"({event.get('timeout_s', 0):g} s from the start)")
                return
            left = f"{event['left']}; " if event.get("left") else ""  # during a restart's backoff
            self.info(f"{left}waiting for {missing} node(s) to join again (--nnodes needs {event.get('need')}), "
                      f"up to the join timeout ({event.get('timeout_s', 0):g} s)")

    def update(self, workers: list[dict[str, Any]], *, attempt: int | None = None, world_size: int | None = None,
               restarts: int = 0) -> None:
        """Redraw the live line from this node's heartbeat: its workers, and the job as this node
        knows it (``attempt`` None: no workers of an attempt run here now, so the job restarts or
        waits). Docs: docs/status.md, "The status line of `unicron run`"."""
        if self._line is None:
            return
        job = dict(self.job, attempt=attempt, restarts=restarts, world_size=world_size,
                   state="running" if attempt is not None else "restarting" if restarts or workers else "starting")
        try:
            self._line.update({"job": job, "nodes": [{"workers": workers}]})
        except Exception:
            self._line = None

    def close(self) -> None:
        if self._line is not None:
            try:
                self._line.close()
            except Exception:
                pass


def fault_line(fault: dict[str, Any], node_id: str) -> str:
    """One line for a fault a node reports: who, at which step, what."""
    node = fault.get("node_id") or node_id
    who = f"rank {fault['rank']}" if fault.get("rank") is not None else f"node {node}"
    what = first_line(str(fault.get("summary") or fault.get("message") or ""))
    if fault.get("error_type") and not fault.get("summary"):
        what = with_type(str(fault["error_type"]), what)
    code = fault.get("exitcode")
    if fault.get("kind") == "exit" and type(code) is int and code > 0 and not fault.get("error_type") \
            and not what.startswith("exit code"):
        # The code first: stderr's last line may be a progress print, not what happened.
        what = f"exit code {code}" + (f", last said: {what}" if what else "")
    step = fault.get("steps_completed")
    # unknown (None) for scripts that report no steps, or a rank that died before its hooks were in
    at = "" if not isinstance(step, int) else " before its first step" if step == 0 else f" at step {step}"
    attempt = fault.get("attempt")
    if isinstance(step, int) and step > 0 and isinstance(attempt, int) and attempt > 0 and not fault.get("restored_from"):
        # Without a restored snapshot the count starts again in every attempt; the script's
        # own step (resumed from its checkpoint) is its business.
        at += f" of attempt {attempt}"
    return f"{fault.get('kind')} on {who}{at}: {clip_line(what or str(fault.get('kind')))}"
