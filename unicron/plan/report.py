"""Turn plans and simulation results into JSON-ready dicts and rich tables (no I/O here)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from unicron.plan.model import PlanInput
from unicron.plan.simulate import SimResult
from unicron.plan.solver import Plan
from unicron.plan.transfers import Transfer, transfer_summary


def plan_to_dict(inp: PlanInput, result: Plan, transfers: list[Transfer]) -> dict[str, Any]:
    summary = transfer_summary(transfers)
    return {
        "assignment": result.assignment,
        "objective": result.objective,
        "waf": result.waf,
        "waf_before": result.waf_before,
        "horizon_s": inp.horizon_s,
        "transition_s": inp.transition_s,
        "failed": list(inp.failed),
        "idle": list(result.idle),
        "jobs": [{
            "name": d.name, "weight": d.weight, "before": list(d.before), "after": list(d.after),
            "nodes_before": len(d.before), "nodes_after": len(d.after), "hit": d.hit, "changed": d.changed,
            "throughput_before": d.rate_before, "throughput_after": d.rate_after, "reward": d.reward,
            "reason": d.reason,
            "transfer_s": summary[d.name].est_s if d.name in summary else 0.0,
        } for d in result.decisions],
        "transfers": [t.to_dict() for t in transfers],
        "transfer_summary": {name: vars(s) for name, s in summary.items()},
    }


def _racks(names: tuple[str, ...], rack_of: dict[str, str]) -> str:
    racks = sorted({rack_of[n] for n in names})
    if not racks:
        return "-"
    return ",".join(racks) if len(racks) <= 2 else f"{len(racks)} racks"


def _change(before: float, after: float) -> str:
    if before == 0:
        return f"{after:.3g}" + (" (new)" if after else "")
    return f"{after:.3g} ({after / before - 1:+.0%})"


def plan_table(inp: PlanInput, result: Plan, transfers: list[Transfer]) -> Group:
    rack_of = {n.name: n.rack for n in inp.nodes}
    jobs = Table(title=f"unicron plan: {len(inp.failed)} failed, {len(inp.healthy)} healthy nodes")
    jobs.add_column("job", overflow="fold")
    jobs.add_column("w", justify="right")
    jobs.add_column("nodes", justify="right", no_wrap=True)
    jobs.add_column("racks")
    jobs.add_column("T after", justify="right")
    jobs.add_column("reward", justify="right")
    jobs.add_column("why", ratio=1)
    for d in result.decisions:
        style = "red" if d.hit else ("yellow" if d.changed else "")
        jobs.add_row(d.name, f"{d.weight:g}", f"{len(d.before)}->{len(d.after)}", _racks(d.after, rack_of),
                     _change(d.rate_before, d.rate_after), f"{d.reward:.3g}", d.reason, style=style)
    change = f" ({result.waf / result.waf_before - 1:+.1%})" if result.waf_before else ""
    lines = [Text(f"WAF {result.waf_before:.4g} -> {result.waf:.4g}{change}; objective {result.objective:.4g} "
                  f"(horizon {inp.horizon_s:g} s, transition {inp.transition_s:g} s); "
                  f"idle healthy nodes: {len(result.idle)}; node lists: --json")]
    summary = transfer_summary(transfers)
    if summary:
        moves = Table(title="state transfers (nearest source first)")
        for column in ("job", "ranks", "moved GB", "sources", "est. s"):
            moves.add_column(column)
        for name, s in summary.items():
            kinds = ", ".join(f"{k} {v}" for k, v in sorted(s.by_kind.items()))
            moves.add_row(name, str(s.ranks), f"{s.bytes / 1e9:.1f}", kinds, f"{s.est_s:.2f}")
        return Group(jobs, *lines, moves)
    return Group(jobs, *lines)


def sim_to_dict(result: SimResult) -> dict[str, Any]:
    base = result.work("unicron") if any(p.name == "unicron" for p in result.policies) else None
    return {
        "duration_s": result.duration_s,
        "events": result.events,
        "bound": result.bound,
        "no_failure": result.no_failure,
        "policies": [{"name": p.name, "work": p.work, "of_bound": p.work / result.bound if result.bound else None,
                      "ratio_to_unicron": (p.work / base) if base else None} for p in result.policies],
    }


def sim_table(result: SimResult) -> Table:
    data = sim_to_dict(result)
    table = Table(title=f"unicron simulate: {result.events} events over {result.duration_s / 3600:.4g} h")
    for column in ("policy", "weighted work", "of no-failure bound", "vs unicron"):
        table.add_column(column, justify="right" if column != "policy" else "left")
    table.add_row("upper bound", f"{result.bound:.4g}", "100.0%", "")
    table.add_row("as placed, no failure", f"{result.no_failure:.4g}",
                  f"{result.no_failure / result.bound:.1%}" if result.bound else "-", "")
    for p in data["policies"]:
        ratio = p["ratio_to_unicron"]
        table.add_row(p["name"], f"{p['work']:.4g}", f"{p['of_bound']:.1%}" if p["of_bound"] is not None else "-",
                      f"{ratio:.3f}x" if ratio is not None else "-")
    return table
