"""Failure traces: node down / node up over time, loaded from JSON or generated.

A trace is ``{"duration_s": D, "events": [{"t": 12.0, "node": "n3", "kind": "down"}, ...],
"source": "..."}``. Generators draw per-node failures as a Poisson process (exponential times
between failures of a healthy node) with a seeded ``random.Random``, so a trace is reproducible.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from unicron.errors import InputError

DAY_S = 86400.0

# Llama 3 405B pre-training (Dubey et al., "The Llama 3 Herd of Models", 2024, Section 3.3.4):
# 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs (2,048 nodes of 8).
LLAMA3_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_NODES = 16384 // 8
# Same source: about 78% of them were confirmed or suspected hardware issues (Table 5: faulty GPU
# 30.1%, GPU HBM3 17.2%, network switch/cable 8.4%, ...); we treat the rest as cleared by a reboot.
LLAMA3_HARDWARE_FRACTION = 0.78
LLAMA3_NODE_MTBF_S = LLAMA3_DAYS * DAY_S * LLAMA3_NODES / LLAMA3_INTERRUPTIONS


@dataclass(frozen=True)
class TraceEvent:
    t: float
    node: str
    kind: str  # "down" or "up"


@dataclass(frozen=True)
class Trace:
    duration_s: float
    events: tuple[TraceEvent, ...]
    source: str = ""

    @staticmethod
    def from_dict(data: Any, nodes: set[str] | None = None) -> Trace:
        """Check a trace; with ``nodes``, also that it names known nodes and never downs a down node."""
        if not isinstance(data, dict):
            raise InputError("trace: expected an object with duration_s and events")
        extra = set(data) - {"duration_s", "events", "source"}
        if extra:
            raise InputError(f"trace.{sorted(extra)[0]}: unknown field (allowed: duration_s, events, source)")
        duration = data.get("duration_s")
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not 0 < duration < math.inf:
            raise InputError(f"trace.duration_s: expected a positive number, got {duration!r}")
        raw = data.get("events")
        if not isinstance(raw, list):
            raise InputError("trace.events: expected a list")
        events = []
        down: set[str] = set()
        last = 0.0
        for i, item in enumerate(raw):
            path = f"trace.events[{i}]"
            if not isinstance(item, dict) or set(item) != {"t", "node", "kind"}:
                raise InputError(f"{path}: expected exactly the fields t, node, kind")
            t, node, kind = item["t"], item["node"], item["kind"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= duration:
                raise InputError(f"{path}.t: expected a time in [0, duration_s], got {t!r}")
            if t < last:
                raise InputError(f"{path}.t: events must be in time order ({t} after {last})")
            if kind not in ("down", "up"):
                raise InputError(f"{path}.kind: expected 'down' or 'up', got {kind!r}")
            if not isinstance(node, str) or (nodes is not None and node not in nodes):
                raise InputError(f"{path}.node: unknown node {node!r}")
            if (kind == "down") == (node in down):
                raise InputError(f"{path}: node {node!r} is already {'down' if kind == 'down' else 'up'}")
            (down.add if kind == "down" else down.discard)(node)
            last = float(t)
            events.append(TraceEvent(float(t), node, kind))
        return Trace(float(duration), tuple(events), str(data.get("source", "")))

    def to_dict(self) -> dict[str, Any]:
        return {"duration_s": self.duration_s, "source": self.source,
                "events": [{"t": e.t, "node": e.node, "kind": e.kind} for e in self.events]}


def poisson_trace(nodes: list[str], duration_s: float, node_mtbf_s: float, *, hardware_fraction: float,
                  hardware_repair_s: float, transient_repair_s: float, seed: int, source: str = "") -> Trace:
    """Each healthy node fails after Exp(node_mtbf_s); it comes back after a hardware repair
    (Exp(hardware_repair_s)) with probability ``hardware_fraction``, else after a reboot
    (Exp(transient_repair_s))."""
    rng = random.Random(seed)
    events: list[TraceEvent] = []
    for node in nodes:
        t = rng.expovariate(1 / node_mtbf_s)
        while t < duration_s:
            events.append(TraceEvent(round(t, 3), node, "down"))
            mean = hardware_repair_s if rng.random() < hardware_fraction else transient_repair_s
            back = t + max(1.0, rng.expovariate(1 / mean))  # >= 1 s: distinct times
            if back >= duration_s:
                break
            events.append(TraceEvent(round(back, 3), node, "up"))
            t = back + max(1.0, rng.expovariate(1 / node_mtbf_s))
    events.sort(key=lambda e: (e.t, e.kind == "down", e.node))
    return Trace(duration_s, tuple(events), source)


def llama3_trace(nodes: list[str], duration_s: float, *, seed: int = 0, hardware_repair_s: float = DAY_S,
                 transient_repair_s: float = 600.0) -> Trace:
    """Failures at the per-node rate of the Llama 3 405B run; repair times are assumptions."""
    source = (f"Llama 3 405B: {LLAMA3_INTERRUPTIONS} unexpected interruptions in {LLAMA3_DAYS} days on "
              f"{LLAMA3_NODES * 8} GPUs (Dubey et al. 2024, sec. 3.3.4) -> node MTBF "
              f"{LLAMA3_NODE_MTBF_S / DAY_S:.0f} days; {LLAMA3_HARDWARE_FRACTION:.0%} hardware, repaired in "
              f"Exp({hardware_repair_s / 3600:g} h), the rest back in Exp({transient_repair_s / 60:g} min); seed {seed}")
    return poisson_trace(nodes, duration_s, LLAMA3_NODE_MTBF_S, hardware_fraction=LLAMA3_HARDWARE_FRACTION,
                         hardware_repair_s=hardware_repair_s, transient_repair_s=transient_repair_s, seed=seed,
                         source=source)


def main(argv: list[str] | None = None) -> int:
    """python -m unicron.plan.trace {llama3,synthetic} --input CLUSTER --days D [--seed S] > trace.json"""
    import argparse
    import json
    import sys
    from pathlib import Path

    from unicron.plan.commands import load_document
    from unicron.plan.model import PlanInput

    parser = argparse.ArgumentParser(prog="python -m unicron.plan.trace", description=main.__doc__)
    parser.add_argument("kind", choices=["llama3", "synthetic"])
    parser.add_argument("--input", required=True, type=Path, help="cluster file (plan input format)")
    parser.add_argument("--days", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtbf-days", type=float, default=2.0, help="synthetic: per-node MTBF")
    parser.add_argument("--repair-hours", type=float, default=24.0, help="mean hardware repair time")
    args = parser.parse_args(argv)
    nodes = [n.name for n in PlanInput.from_dict(load_document(args.input)).nodes]
    duration = args.days * DAY_S
    if args.kind == "llama3":
        trace = llama3_trace(nodes, duration, seed=args.seed, hardware_repair_s=args.repair_hours * 3600)
    else:
        trace = poisson_trace(
            nodes, duration, args.mtbf_days * DAY_S, hardware_fraction=LLAMA3_HARDWARE_FRACTION,
            hardware_repair_s=args.repair_hours * 3600, transient_repair_s=600.0, seed=args.seed,
            source=f"synthetic: per-node MTBF {args.mtbf_days:g} days, {LLAMA3_HARDWARE_FRACTION:.0%} hardware "
                   f"repaired in Exp({args.repair_hours:g} h), the rest back in Exp(10 min); seed {args.seed}")
    json.dump(trace.to_dict(), sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
