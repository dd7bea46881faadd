"""What the agent knows of each local rank of an attempt, and the attempt's shape."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from unicron.agent.logs import RankLogs
from unicron.agent.procs import WorkerProcess


@dataclass
class RankState:
    rank: int
    local_rank: int
    proc: WorkerProcess
    logs: RankLogs
    started_at: float
    state: str = "running"
    step: int = 0
    last_step_at: float | None = None
    iter_times: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    exception: dict[str, Any] | None = None
    exitcode: int | None = None
    exited_at: float | None = None
    snapshot_step: int | None = None
    steps_in_attempt: int = 0
    hooked: bool = False  # said hello: its stack-dump signal handler is installed
    ready_at: float | None = None  # when it got past start-up (torch.distributed initialised)
    steps_expected: bool = False  # built an optimizer: it will report steps
    exiting_code: int | None = None  # announced a non-zero SystemExit; not reaped yet
    exiting_at: float | None = None
    bye_at: float | None = None  # (monotonic) its script ended cleanly; the interpreter may still tear down
    closed: bool = False  # destroyed its default process group (since its last step): past its collectives
    lingering_named: bool = False  # said to have outlived its script (WorkerGroup.lingering_notices)


@dataclass(frozen=True)
class GroupSpec:
    attempt: int
    restart_count: int
    rank_offset: int
    world_size: int
    node_rank: int
    nnodes: int
    local_world_sizes: tuple[int, ...]
    master_addr: str
    master_port: int
    restore_step: int | None
    inject: str
    restore_note: str = ""  # why nothing is restored though snapshots were kept ("" otherwise)


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[len(s) // 2], 5)
