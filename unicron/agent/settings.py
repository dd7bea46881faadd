"""What the agent needs, resolved once from the launch configuration."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from unicron.agent.logs import LogSpec


@dataclass(frozen=True)
class AgentSettings:
    run_id: str
    min_nodes: int
    max_nodes: int
    nproc: int
    node_rank: int | None
    max_restarts: int
    role: str
    rdzv_host: str
    rdzv_port: int
    embed_coordinator: bool  # try to host the coordinator at rdzv_host:rdzv_port
    coordinator: str | None  # HOST:PORT of a standalone coordinator, if any
    local_addr: str
    advertise_addr: str  # MASTER_ADDR workers get when this node hosts the store
    log_spec: LogSpec
    cmd: tuple[str, ...]
    inject: str  # UNICRON_INJECT value for the first attempt ('' for none)
    grace_s: float
    monitor_interval_s: float
    hang_factor: float
    hang_floor_s: float
    hang_warmup_steps: int
    hang_busy_factor: float
    hang_busy_floor_s: float
    first_step_timeout_s: float
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    last_call_s: float
    join_timeout_s: float
    secret: bytes
    secret_file: str | None
    weight: float
    status_line: str
    metrics_port: int | None
    # (local_rank, rank, world_size, group_rank, group_world_size, local_world_size,
    #  role_rank, role_world_size, master_addr, master_port, restart_count, error_file) -> env
    worker_env: Callable[..., Mapping[str, str]]
    warm: bool = True
    # --rdzv-conf is_host: host the embedded coordinator (True: even where the endpoint's name
    # does not look like this machine), never (False), or whoever binds the port first (None)
    is_host: bool | None = None
    signals: tuple[int, ...] = (15, 2, 1, 3)  # SIGTERM, SIGINT, SIGHUP, SIGQUIT (torchrun's default)
    warnings: tuple[str, ...] = ()
    secret_generated: bool = False  # no secret was given: one was drawn for a job hosting its own coordinator
