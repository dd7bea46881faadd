"""`unicron plan` and `unicron simulate`: the thin shell around the planner and the simulator."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer
import yaml
from rich.console import Console

from unicron.errors import InputError, UsageError
from unicron.plan.model import PlanInput
from unicron.plan.report import plan_table, plan_to_dict, sim_table, sim_to_dict
from unicron.plan.simulate import POLICIES, SimParams, simulate
from unicron.plan.solver import plan
from unicron.plan.trace import Trace
from unicron.plan.transfers import transfer_plan
from unicron.smallfile import NotReadable, read_regular

INPUT_MAX_BYTES = 64 << 20  # a cluster description or a failure trace


def load_document(path: Path, what: str = "--input") -> Any:
    """Read a JSON or YAML file (by suffix; anything else is tried as JSON, then YAML)."""
    try:
        text = read_regular(path, INPUT_MAX_BYTES).decode("utf-8")
    except OSError as exc:
        raise InputError(f"{what}: cannot read {path}: {exc.strerror or exc}") from exc
    except NotReadable as exc:
        raise InputError(f"{what}: cannot read {path}: it {exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{what}: {path} is not UTF-8 text") from exc
    suffix = path.suffix.lower()
    if suffix != ".json":
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" (line {mark.line + 1})" if mark is not None else ""
            if suffix in (".yaml", ".yml"):
                raise InputError(f"{what}: {path} is not valid YAML{where}") from exc
        except (RecursionError, ValueError) as exc:  # nested too deep; an integer of 5000 digits
            if suffix in (".yaml", ".yml"):
                raise InputError(f"{what}: {path} is not valid YAML ({_first_clause(exc)})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{what}: {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    except (RecursionError, ValueError) as exc:
        raise InputError(f"{what}: {path} is not valid JSON ({_first_clause(exc)})") from None


def _first_clause(exc: BaseException) -> str:
    """``maximum recursion depth exceeded``, ``Exceeds the limit (4300 digits) for integer string
    conversion``: the reason, without Python's advice on how to lift the limit."""
    return (str(exc) or type(exc).__name__).split(";")[0].split(":")[0].strip()


def load_plan_input(path: Path) -> PlanInput:
    document = load_document(path)
    try:
        return PlanInput.from_dict(document)
    except InputError as err:  # which file (28C F6: a trace given as --input named its field only)
        hint = " (a failure trace: give it to `unicron simulate --trace`)" if isinstance(document, dict) \
            and "events" in document and "nodes" not in document else ""
        raise InputError(f"{path}: {err}{hint}") from None


def run_plan(path: Path, as_json: bool, console: Console | None = None) -> dict[str, Any]:
    inp = load_plan_input(path)
    result = plan(inp)
    transfers = transfer_plan(inp, result)
    data = plan_to_dict(inp, result, transfers)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
    else:
        (console or Console()).print(plan_table(inp, result, transfers))
    return data


def register(app: typer.Typer) -> None:
    """Add `plan` and `simulate` to the unicron typer app."""

    @app.command("plan")
    def plan_command(
        input_file: Path = typer.Option(..., "--input", "-i", help="cluster, jobs and failed nodes (JSON or YAML)"),
        as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
    ) -> None:
        """Dry run of the cost-aware planner: what would run where after the failure, and why."""
        run_plan(input_file, as_json)

    @app.command("simulate")
    def simulate_command(
        input_file: Path = typer.Option(..., "--input", "-i", help="cluster and jobs (same format as plan)"),
        trace_file: Path = typer.Option(..., "--trace", "-t", help="failure trace (JSON or YAML)"),
        plot: Path | None = typer.Option(None, "--plot", help="write a plot of accumulated work here"),
        as_json: bool = typer.Option(False, "--json", help="print the results as JSON"),
        policy: list[str] = typer.Option(list(POLICIES), "--policy", help="policies to run (repeatable)"),
        detect_s: float = typer.Option(SimParams.detect_s, help="baselines: seconds until a hang is noticed"),
        restart_s: float = typer.Option(SimParams.restart_s, help="restart policy: resubmit + set-up seconds"),
        setup_s: float = typer.Option(SimParams.setup_s, help="shrink policy: set-up seconds"),
        checkpoint_interval_s: float = typer.Option(SimParams.checkpoint_interval_s,
                                                     help="baselines: running seconds between checkpoints"),
        redundancy_overhead: float = typer.Option(SimParams.redundancy_overhead,
                                                   help="redundancy policy: throughput lost to redundant work"),
        redundancy_recovery_s: float = typer.Option(SimParams.redundancy_recovery_s,
                                                     help="redundancy policy: seconds to carry on after a loss"),
    ) -> None:
        """Replay a failure trace through unicron and the baseline recovery policies."""
        for name in policy:
            if name not in POLICIES:
                raise UsageError(f"--policy: unknown policy {name!r} (known: {', '.join(POLICIES)})")
        for flag, value in (("--detect-s", detect_s), ("--restart-s", restart_s), ("--setup-s", setup_s),
                            ("--checkpoint-interval-s", checkpoint_interval_s),
                            ("--redundancy-overhead", redundancy_overhead),
                            ("--redundancy-recovery-s", redundancy_recovery_s)):
            if not math.isfinite(value):  # NaN passes every `< 0` check below (29C F2: an internal error)
                raise UsageError(f"{flag} must be a finite number, got {value}")
        if not 0 <= redundancy_overhead < 1:
            raise UsageError("--redundancy-overhead: must be in [0, 1)")
        if checkpoint_interval_s <= 0:
            raise UsageError("--checkpoint-interval-s must be > 0")
        for flag, seconds in (("--detect-s", detect_s), ("--restart-s", restart_s), ("--setup-s", setup_s),
                              ("--redundancy-recovery-s", redundancy_recovery_s)):
            if seconds < 0:  # named (27C F13: "times must be >= 0")
                raise UsageError(f"{flag} must be >= 0, got {seconds:g}")
        if plot is not None:
            from unicron.plan.plot import check_plot_path

            check_plot_path(plot)  # before a simulation that may take minutes
        inp = load_plan_input(input_file)
        try:
            trace = Trace.from_dict(load_document(trace_file, "--trace"), {n.name for n in inp.nodes})
        except InputError as err:
            raise InputError(f"{trace_file}: {err}") from None
        params = SimParams(detect_s=detect_s, restart_s=restart_s, setup_s=setup_s,
                           checkpoint_interval_s=checkpoint_interval_s, redundancy_overhead=redundancy_overhead,
                           redundancy_recovery_s=redundancy_recovery_s)
        result = simulate(inp, trace, params, tuple(dict.fromkeys(policy)))
        if plot is not None:
            from unicron.plan.plot import plot_simulation

            plot_simulation(result, plot, title=f"{result.events} events; " + trace.source.split(";")[0])
        if as_json:
            typer.echo(json.dumps(sim_to_dict(result), indent=2))
        else:
            Console().print(sim_table(result))
