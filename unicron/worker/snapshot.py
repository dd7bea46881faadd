"""Layout of ``unicron.State`` snapshots on disk (shared memory), and choosing a restore step.

``$UNICRON_SNAPSHOT_DIR/rank{R}/step{S:010d}.pt`` is the marker of "S steps completed" for rank
R: a small JSON file naming the ``slot{k}.bin`` that holds the raw tensors (format and commit
protocol in ``snapslots``). It is written to ``step{S:010d}.pt.tmp`` and renamed once the data
is in place, and removed before its slot is reused, so a ``.pt`` that exists is complete. Each
worker keeps its newest ``KEEP`` snapshots.

Why three: a rank's snapshot of step k completes before its optimizer steps again, so when
rank A has committed step k a rank B in lockstep has at least k-1 complete, and a rank killed
while its snapshot of k was in flight still has k-1; two kept would leave a common step, three
leave a margin for a training loop whose ranks synchronise less than once per step, at
``KEEP`` times the state in shared memory.

Torch-free: the agent imports this to pick ``UNICRON_RESTORE_STEP`` (``common_step``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

KEEP = 3
_SNAPSHOT = re.compile(r"^step(\d{10})\.pt$")
_RANK_DIR = re.compile(r"^rank(\d+)$")


def rank_dir(root: str | os.PathLike[str], rank: int) -> Path:
    return Path(root) / f"rank{rank}"


def snapshot_name(step: int) -> str:
    return f"step{step:010d}.pt"


def snapshot_path(root: str | os.PathLike[str], rank: int, step: int) -> Path:
    return rank_dir(root, rank) / snapshot_name(step)


def list_steps(directory: str | os.PathLike[str]) -> list[int]:
    """Complete snapshots in one rank's directory, ascending (missing directory: none)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(_SNAPSHOT.match, names) if m)


def steps_by_rank(root: str | os.PathLike[str]) -> dict[int, list[int]]:
    """``{rank: [steps...]}`` for every ``rank{R}`` directory under root."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return {}
    found = {}
    for name in names:
        m = _RANK_DIR.match(name)
        if m:
            found[int(m.group(1))] = list_steps(Path(root) / name)
    return found


def common_step(steps: Mapping[int, Iterable[int]], ranks: Iterable[int]) -> int | None:
    """Newest step every one of ``ranks`` has a snapshot of; None if there is none."""
    common: set[int] | None = None
    for rank in ranks:
        have = set(steps.get(rank, ()))
        common = have if common is None else common & have
        if not common:
            return None
    return max(common) if common else None


def steps_to_prune(steps: Iterable[int], keep: int) -> list[int]:
    """All but the newest ``keep`` steps."""
    ordered = sorted(steps)
    return ordered[:-keep] if keep > 0 else ordered


def prune(directory: str | os.PathLike[str], keep: int) -> None:
    for step in steps_to_prune(list_steps(directory), keep):
        try:
            os.unlink(Path(directory) / snapshot_name(step))
        except FileNotFoundError:
            pass


def remove_partial(directory: str | os.PathLike[str]) -> None:
    """Remove ``.tmp`` files a killed writer left behind (they hold shared memory)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if name.endswith(".pt.tmp"):
            try:
                os.unlink(Path(directory) / name)
            except FileNotFoundError:
                pass
