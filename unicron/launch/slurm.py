"""What a Slurm allocation tells `unicron run` (e.g. under `srun unicron run ...`).

Pure: reads a mapping of environment variables, never the process environment itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
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


def _range_bounds(item: str) -> tuple[int, int, int]:
    """(first, last, zero-padded width) of one bracket item such as ``01-04`` or ``7``."""
    lo, dash, hi = item.partition("-")
    if not lo.isdigit() or (dash and not hi.isdigit()):
        raise ValueError(f"bad range {item!r}")
    if dash and int(hi) < int(lo):
        raise ValueError(f"descending range {item!r}")
    return int(lo), int(hi) if dash else int(lo), len(lo)  # zero padding is kept: 01-04 -> 01 02 03 04


def _host_parts(pattern: str) -> tuple[str, list[tuple[int, int, int]], str] | None:
    """A host pattern's text before its first bracket group, the group's ranges, and the rest;
    None for a plain name. Checks the whole pattern's syntax, expanding nothing."""
    match = re.search(r"\[([^\[\]]*)\]", pattern)
    if match is None:
        if "[" in pattern or "]" in pattern:
            raise ValueError(f"bad host pattern {pattern!r}")
        return None
    ranges = [_range_bounds(item.strip()) for item in match.group(1).split(",")]
    tail = pattern[match.end():]
    if tail:
        _host_parts(tail)
    return pattern[: match.start()], ranges, tail


def _iter_host(pattern: str) -> Iterator[str]:
    """The names of one host pattern, lazily: ``n[1-99999999]`` must not be built in memory
    when only its first name is wanted. Several bracket groups expand as a product, in Slurm's
    order."""
    groups: list[tuple[str, list[tuple[int, int, int]]]] = []  # each bracket group, parsed once
    rest: str = pattern
    while (parts := _host_parts(rest)) is not None:
        head, ranges, rest = parts
        groups.append((head, ranges))
    return _expand(groups, rest)


def _expand(groups: list[tuple[str, list[tuple[int, int, int]]]], end: str) -> Iterator[str]:
    if not groups:
        yield end
        return
    (head, ranges), inner = groups[0], groups[1:]
    for lo, hi, width in ranges:
        for n in range(lo, hi + 1):
            for rest in _expand(inner, end):
                yield f"{head}{str(n).zfill(width)}{rest}"


def iter_nodelist(nodelist: str) -> Iterator[str]:
    """The host names of a Slurm hostlist such as ``node[01-04,07],gpu3``, in order, lazily.

    Raises ``ValueError`` for a malformed list, at once (before the first name)."""
    parts = _split_top_level(nodelist)
    for part in parts:
        _host_parts(part)
    if not parts:
        raise ValueError("empty node list")
    return (host for part in parts for host in _iter_host(part))


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host name of a Slurm hostlist, in order (see ``iter_nodelist``)."""
    return list(iter_nodelist(nodelist))


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
            first_host = next(iter_nodelist(nodelist))
        except ValueError as err:
            raise ConfigError(f"{source['first_host']}: cannot read node list {nodelist!r}: {err}") from None
    return SlurmInfo(job_id, nnodes, node_rank, first_host, source)
