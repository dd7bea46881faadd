"""Pure rendering of a coordinator status snapshot (see docs/status.md).

Every function here takes the snapshot and the current time as arguments and returns a rich
renderable or a string, so the view is tested with a recording console and no processes.
A snapshot arrives over the network: every field may be missing or of an odd type, and the
view degrades to "-" instead of raising.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from unicron.status.fmt import (
    event_details,
    fmt_age,
    fmt_bytes,
    fmt_iter_time,
    num,
    plausible,
    short_value,
    sparkline,
)

JOB_STATE_STYLE = {"running": "bold green", "waiting": "bold cyan", "restarting": "bold yellow",
                   "done": "bold blue", "failed": "bold red"}
NODE_STATE_STYLE = {"healthy": "green", "lost": "bold red", "left": "dim", "exited": "dim", "stopped": "dim"}
WORKER_STATE_STYLE = {"running": "green", "exited": "dim", "failed": "bold red", "hung": "bold magenta"}
GONE_NODE_STATES = ("lost", "left", "excluded")  # a node no longer heard from: its figures are stale
SEVERITY_STYLE = {"SEV3": "cyan", "SEV2": "yellow", "SEV1": "bold yellow", "FATAL": "bold red"}


# -- snapshot accessors ----------------------------------------------------------------------------

def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def job_of(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    return _dict(snapshot.get("job"))


def nodes_of(snapshot: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [n for n in _list(snapshot.get("nodes")) if isinstance(n, dict)]


def workers_of(snapshot: Mapping[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every (node, worker) pair, ordered by global rank."""
    pairs = [(node, w) for node in nodes_of(snapshot) for w in _list(node.get("workers")) if isinstance(w, dict)]
    return sorted(pairs, key=lambda p: (num(p[1].get("rank")) is None, num(p[1].get("rank")) or 0.0))


def nodes_not_shown(snapshot: Mapping[str, Any]) -> int:
    """Nodes the coordinator left out of a reply that would have passed the message size limit
    (``unicron.coord.statusfit``); 0 when it sent them all."""
    n = num(job_of(snapshot).get("nodes_not_shown"))
    return int(n) if n and n > 0 else 0


def min_step(snapshot: Mapping[str, Any]) -> int | None:
    """The step every live rank has completed (the job's progress), None without ranks."""
    steps = [num(w.get("step")) for _, w in workers_of(snapshot) if w.get("state") != "exited"]
    known = [int(s) for s in steps if s is not None]
    return min(known) if known else None


def steps_per_second(snapshot: Mapping[str, Any]) -> float | None:
    """Job throughput from the slowest rank's median recent iteration time (DDP runs in lockstep)."""
    medians = []
    for _, w in workers_of(snapshot):
        times = [t for t in (num(x) for x in _list(w.get("iter_times"))) if t is not None and t > 0]
        if not times and (t := num(w.get("iter_time_s"))):
            times = [t]
        if times:
            medians.append(statistics.median(times))
    return 1.0 / max(medians) if medians else None


def state_text(state: Any, styles: Mapping[str, str]) -> Text:
    label = str(state) if state not in (None, "") else "?"
    return Text(label, style=styles.get(label, "white"))


# -- the view ----------------------------------------------------------------------------------------

def _count(value: Any, default: int) -> int:
    n = num(value)
    return default if n is None else int(n)


def render_header(snapshot: Mapping[str, Any], now: float) -> Text:
    job = job_of(snapshot)
    text = Text()
    text.append(str(job.get("id", "?")), style="bold")
    text.append("  ")
    text.append(state_text(job.get("state"), JOB_STATE_STYLE))
    restarts, budget = job.get("restarts", 0), job.get("max_restarts")
    restart_style = "yellow" if num(restarts) else ""
    parts: list[tuple[str, str]] = [
        (f"attempt {job.get('attempt', 0)}", ""),
        (f"restarts {restarts}/{budget if budget is not None else '-'}", restart_style),
        (f"world {job.get('world_size', '-')}", ""),
        (f"nodes {_count(job.get('nnodes'), len(nodes_of(snapshot)))} "
         f"({job.get('min_nodes', '-')}..{job.get('max_nodes', '-')})", ""),
    ]
    step = min_step(snapshot)
    if step is not None:
        parts.append((f"step {step}", "bold"))
    sps = steps_per_second(snapshot)
    if sps is not None and job.get("state") == "running":  # a waiting or stopping job trains at no rate
        parts.append((f"{sps:.3g} it/s", ""))
    parts.append((f"up {uptime(job, now)}", "dim"))
    if job.get("coordinator"):
        parts.append((f"coord {job['coordinator']}", "dim"))
    if num(job.get("restore_step")) is not None:
        parts.append((f"restored from step {job['restore_step']}", "cyan"))
    if job.get("silence_excused") is True:
        parts.append(("silent nodes not judged: the coordinator's own link is suspect", "yellow"))
    dropped = num(job.get("dropped_messages"))
    if dropped:
        parts.append((f"dropped msgs {dropped:.0f}", "yellow"))
    for label, style in parts:
        text.append(" · ", style="dim")
        text.append(label, style=style)
    if job.get("state") in ("done", "failed") and (job.get("reason") or job.get("exit_code") is not None):
        text.append(f"\nended: exit {job.get('exit_code', '-')}", style=JOB_STATE_STYLE[str(job["state"])])
        if job.get("reason"):
            text.append(f" · {short_value(job['reason'], 200)}")
    return text


def gpu_summary(health: Mapping[str, Any]) -> Text:
    gpus = [g for g in _list(health.get("gpus")) if isinstance(g, dict)]
    if not gpus:
        return Text("no GPU", style="dim")
    utils = [u for u in (num(g.get("util")) for g in gpus) if u is not None]
    used = sum(num(g.get("mem_used")) or 0.0 for g in gpus)
    total = sum(num(g.get("mem_total")) or 0.0 for g in gpus)
    temps = [t for t in (num(g.get("temp")) for g in gpus) if t is not None]
    text = Text(f"{len(gpus)}× ")
    if utils:
        text.append(f"{sum(utils) / len(utils):.0f}% ")
    if total:
        text.append(f"{fmt_bytes(used)}/{fmt_bytes(total)} ")
    if temps:
        hot = max(temps)
        text.append(f"{hot:.0f}°C", style="bold red" if hot >= 85 else "")
    text.append(_xids(health, " "))
    return text


def _xids(health: Mapping[str, Any], lead: str = "") -> Text:
    """The Xid errors its GPUs reported; "-" for none."""
    xids = sorted({str(x) for g in _list(health.get("gpus")) if isinstance(g, dict) for x in _list(g.get("xid"))})
    if not xids:
        return Text("" if lead else "-", style="dim")
    return Text(f"{lead}Xid {','.join(xids)}", style="bold red")


def _percent(value: Any, warn: float = 90.0) -> Text:
    v = num(value)
    if v is None:
        return Text("-", style="dim")
    return Text(f"{v:.0f}%", style="bold red" if v >= warn else "")


def _between_steps(activity: object) -> Text:
    # Idle is the normal state while steps flow (nothing is sampled then): shown as "-".
    if activity in ("busy", "working"):
        return Text(str(activity), style="yellow" if activity == "busy" else "cyan")
    return Text("-", style="dim")


def render_nodes(snapshot: Mapping[str, Any], now: float) -> Table:
    hidden = nodes_not_shown(snapshot)
    gone = num(job_of(snapshot).get("gone_nodes_not_shown"))
    notes = ([f"{hidden} more nodes not shown (kept under the message size limit; nodes in trouble come first)"]
             if hidden else []) + ([f"{int(gone)} earlier nodes that left or were lost not shown"]
                                   if gone and gone > 0 else [])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, expand=False, title_justify="left",
                  title=Text("nodes", style="bold"), caption_justify="left",
                  caption=Text("\n".join(notes), style="yellow") if notes else None)
    for name, justify in (("#", "right"), ("node", "left"), ("host", "left"), ("state", "left"),
                          ("heartbeat", "right"), ("activity", "left"), ("cpu", "right"), ("mem", "right"),
                          ("gpus", "left")):
        # Only the GPU summary may wrap: rich then narrows it first when the terminal is narrow.
        table.add_column(name, justify=justify, no_wrap=name != "gpus")  # type: ignore[arg-type]
    for node in nodes_of(snapshot):
        health = _dict(node.get("health"))
        rank = node.get("node_rank")
        # A lost or departed node's figures are its last heartbeat's, from before it went
        # silent: shown as unknown, not as its load now (acceptance 33B F3: "busy, cpu 100%"
        # on a node long dead). An Xid it reported stays: it may say why it was lost.
        gone = node.get("state") in GONE_NODE_STATES
        # -1: joined, no place in an attempt yet (waiting, or lost before it got one)
        table.add_row(str(rank) if isinstance(rank, int) and rank >= 0 else "-", short_value(node.get("node_id", "?"), 24),
                      short_value(node.get("host", "-"), 24), state_text(node.get("state"), NODE_STATE_STYLE),
                      fmt_age(node.get("last_heartbeat"), now), _between_steps(None if gone else node.get("activity")),
                      _percent(None if gone else health.get("cpu_percent"), 98),
                      _percent(None if gone else health.get("mem_percent")),
                      _xids(health) if gone else gpu_summary(health))
    return table


def render_ranks(snapshot: Mapping[str, Any], now: float) -> Table:
    hidden = nodes_not_shown(snapshot)
    notes = ([f"ranks of {hidden} more nodes not shown"] if hidden else []) + (
        ["no trend: iteration times not sent (message size limit)"]
        if job_of(snapshot).get("iter_times_not_shown") else [])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left", title=Text("ranks", style="bold"),
                  caption=Text("\n".join(notes), style="yellow") if notes else None, caption_justify="left")
    for name, justify in (("rank", "right"), ("node", "right"), ("pid", "right"), ("state", "left"),
                          ("step", "right"), ("iter", "right"), ("trend", "left"), ("last step", "right")):
        # The sparkline column is wrapable so rich narrows it first; its Text is cropped, not wrapped.
        table.add_column(name, justify=justify, no_wrap=name != "trend")  # type: ignore[arg-type]
    for node, w in workers_of(snapshot):
        times = _list(w.get("iter_times"))
        shown, recent = num(w.get("iter_time_s")), [t for t in (num(x) for x in times) if t is not None]
        # A rank whose latest step took far longer than its recent median is the straggler to look at.
        slow = len(recent) >= 3 and recent[-1] > 2 * statistics.median(recent)
        # pid and step are null for a rank its node never reported (lost while starting it)
        table.add_row(str(w.get("rank", "-")), str(node.get("node_rank", "-")), str(w.get("pid") or "-"),
                      state_text(w.get("state"), WORKER_STATE_STYLE), _or_dash(w.get("step")),
                      Text(fmt_iter_time(shown), style="yellow" if slow else ""),
                      Text(sparkline(times), style="cyan", no_wrap=True, overflow="crop"),
                      fmt_age(w.get("last_step_at"), now))
    return table


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def render_restarts(snapshot: Mapping[str, Any], now: float, limit: int = 5) -> Table | None:
    restarts = [r for r in _list(snapshot.get("restarts")) if isinstance(r, dict)]
    if not restarts:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left",
                  title=Text(f"restarts ({len(restarts)})", style="bold"))
    for name, justify in (("#", "right"), ("ago", "right"), ("sev", "left"), ("action", "left"), ("cause", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "cause")  # type: ignore[arg-type]
    for r in restarts[-limit:]:
        sev = str(r.get("severity", "-"))
        table.add_row(str(r.get("attempt", "-")), fmt_age(r.get("ts"), now), Text(sev, style=SEVERITY_STYLE.get(sev, "")),
                      str(r.get("action", "-")), short_value(r.get("cause", "-"), 200))
    return table


def _summary_line(label: str, mapping: Mapping[str, Any], now: float) -> Text:
    text = Text(f"{label}: ", style="bold")
    parts = []
    for key, value in mapping.items():
        if value in ("", None, [], {}):
            continue
        # Keys naming a moment ("since", "started_at", "ts") read better as an age.
        if (key in ("since", "ts") or key.endswith("_at")) and num(value):
            parts.append(f"{key} {fmt_age(value, now)} ago")
        else:
            parts.append(f"{key}={short_value(value, 40)}")
    text.append(" ".join(parts) if parts else "-")
    return text


def render_plan(snapshot: Mapping[str, Any], now: float) -> list[Text]:
    """The transition under way (if any) and the current plan, one line each."""
    plan = _dict(snapshot.get("plan"))
    lines = []
    transition = snapshot.get("transition") or plan.get("transition")
    if isinstance(transition, dict):
        lines.append(_summary_line("transition", transition, now))
    elif transition:
        lines.append(Text.assemble(("transition: ", "bold"), (short_value(transition, 200), "yellow")))
    rest = {k: v for k, v in plan.items() if k != "transition" and v not in ("", None, [], {})}
    if rest:
        lines.append(_summary_line("plan", rest, now))
    return lines


def render_events(snapshot: Mapping[str, Any], now: float, limit: int = 8) -> Table | None:
    events = [e for e in _list(snapshot.get("events")) if isinstance(e, dict)]
    if not events:
        return None
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left", title=Text("events", style="bold"))
    table.add_column("ago", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    # A wrapable column is what rich narrows first; the Text itself stays on one line.
    table.add_column("details")
    for e in events[-limit:]:
        table.add_row(fmt_age(e.get("ts"), now), Text(str(e.get("kind", "?")), style=event_style(e)),
                      Text(event_details(e), no_wrap=True, overflow="ellipsis"))
    return table


def event_style(event: Mapping[str, Any]) -> str:
    kind = str(event.get("kind", ""))
    if any(word in kind for word in ("fail", "fatal", "lost", "hang", "fault", "exit")):
        return "bold red"
    if any(word in kind for word in ("restart", "stop", "transition", "decision", "reconfig")):
        return "yellow"
    if kind in ("done", "finished", "run_end"):
        return "bold blue"
    return "cyan"


def render_status(snapshot: Mapping[str, Any], now: float, *, events: int = 8,
                  banner: RenderableType | None = None) -> RenderableType:
    """The full status view of one job: header, nodes, ranks, restarts, plan, latest events."""
    snapshot = plausible(snapshot)
    parts: list[RenderableType] = []
    if banner is not None:
        parts.append(banner)
    parts.append(render_header(snapshot, now))
    parts.append(render_nodes(snapshot, now))
    parts.append(render_ranks(snapshot, now))
    restarts = render_restarts(snapshot, now)
    if restarts is not None:
        parts.append(restarts)
    parts.extend(render_plan(snapshot, now))
    latest = render_events(snapshot, now, events)
    if latest is not None:
        parts.append(latest)
    return Panel(Group(*parts), title=Text("unicron status", style="bold"), title_align="left",
                 border_style=JOB_STATE_STYLE.get(str(job_of(snapshot).get("state")), "white").split()[-1],
                 box=box.ROUNDED, padding=(0, 1))


def render_runs(rows: Sequence[tuple[Mapping[str, Any], Mapping[str, Any] | None, str]], now: float) -> Table:
    """Compact table of several runs: (run info, snapshot or None, error text) per row."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left",
                  title=Text(f"{len(rows)} unicron runs on this machine", style="bold"))
    for name, justify in (("job", "left"), ("endpoint", "left"), ("state", "left"), ("restarts", "right"),
                          ("ranks", "right"), ("step", "right"), ("it/s", "right"), ("up", "right")):
        # Job ids and endpoints fold onto a second line before the numbers get cut.
        table.add_column(name, justify=justify, no_wrap=name not in ("job", "endpoint"),  # type: ignore[arg-type]
                         overflow="fold", min_width=8 if name in ("job", "endpoint") else None)
    for info, snapshot, error in rows:
        job_id, endpoint = str(info.get("job", "?")), str(info.get("endpoint", "-"))
        if snapshot is None:
            table.add_row(job_id, endpoint, Text(error or "no answer", style="red"), "", "", "", "",
                          fmt_age(info.get("started_at"), now))
            continue
        job = job_of(snapshot)
        sps = steps_per_second(snapshot)
        step = min_step(snapshot)
        table.add_row(job_id, endpoint, state_text(job.get("state"), JOB_STATE_STYLE),
                      f"{job.get('restarts', 0)}/{job.get('max_restarts', '-')}",
                      # with nodes left out of the reply, the world size says how many there are
                      str(job.get("world_size", "-") if nodes_not_shown(snapshot) else len(workers_of(snapshot))),
                      "-" if step is None else str(step), "-" if sps is None else f"{sps:.3g}",
                      uptime(job, now, info.get("started_at")))
    return table


def uptime(job: Mapping[str, Any], now: float, started: Any = None) -> str:
    """How long the job ran: up to its ``ended_at`` once it is over. A standalone coordinator
    keeps showing an ended job, whose "up" grew for ever (29C F7). ``started``: the run's
    registry entry's, for a coordinator that sends none."""
    start, end = num(job.get("started_at")) or num(started), num(job.get("ended_at"))
    return fmt_age(start, end if end is not None and start is not None and end >= start else now)
