"""What a Slurm allocation tells `unicron run` (e.g. under `srun unicron run ...`).

Pure: reads a mapping of environment variables, never the process environment itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from unicron.errors import ConfigError


@dataclass(frozen=True)
class SlurmInfo:
    """Values unicron takes from Slurm when the user did not give them (all raw strings, so
    they go through the same converters as flags; ``source`` names each variable)."""

    job_id: str
    nnodes: str | None
    node_rank: str | None
    first_host: str | None
    source: Mapping[str, str]  # field -> variable it came from


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: "a[1-2,5],b" -> ["a[1-2,5]", "b"]."""
    parts: list[str] = []
    depth = 0
    current = ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append(current)
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(item: str) -> list[str]:
    lo, dash, hi = item.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()):
        raise ValueError(f"bad range {item!r}")
    if not dash:
        return [lo]
    if int(hi) < int(lo):
        raise ValueError(f"descending range {item!r}")
    width = len(lo)  # zero padding is kept: 01-04 -> 01 02 03 04
    return [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]


def _expand_host(pattern: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"bad host pattern {pattern!r}")
        return [pattern]
    head, tail = pattern[: match.start()], pattern[match.end():]
    numbers = [n for item in match.group(1).split(",") for n in _expand_range(item.strip())]
    # Several bracket groups in one name expand as a product, in Slurm's order.
    return [f"{head}{n}{rest}" for n in numbers for rest in _expand_host_tail(tail)]


def _expand_host_tail(tail: str) -> list[str]:
    return _expand_host(tail) if tail else [""]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm hostlist such as ``node[01-04,07],gpu3`` into host names, in order.

    Raises ``ValueError`` for a malformed list."""
    hosts = [h for part in _split_top_level(nodelist) for h in _expand_host(part)]
    if not hosts:
        raise ValueError("empty node list")
    return hosts


def slurm_info(environ: Mapping[str, str]) -> SlurmInfo | None:
    """None outside Slurm (no SLURM_JOB_ID); else what the allocation says."""
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return None
    source: dict[str, str] = {"job_id": "SLURM_JOB_ID"}

    def first_of(name: str, *variables: str) -> str | None:
        for var in variables:
            value = environ.get(var, "").strip()
            if value:
                source[name] = var
                return value
        return None

    nnodes = first_of("nnodes", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_rank = first_of("node_rank", "SLURM_NODEID")
    nodelist = first_of("first_host", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    first_host = None
    if nodelist is not None:
        try:
            first_host = expand_nodelist(nodelist)[0]
        except ValueError as err:
            raise ConfigError(f"{source['first_host']}: cannot read node list {nodelist!r}: {err}") from None
    return SlurmInfo(job_id, nnodes, node_rank, first_host, source)
