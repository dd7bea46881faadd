"""LaunchConfig (what the user asked) -> AgentSettings (what one agent needs).

The one place that knows both shapes, so the launcher's option names and the agent's
internals can change independently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import replace

from unicron.agent.logs import LogSpec, Std
from unicron.agent.settings import AgentSettings
from unicron.errors import UsageError
from unicron.launch.args import StdSpec as LaunchStd
from unicron.launch.config import LaunchConfig
from unicron.launch.workerenv import master_addr_for, worker_command, worker_env

STOP_MARGIN_S = 10.0


def _std(spec: LaunchStd) -> Std | dict[int, Std]:
    if spec.per_rank:
        return {rank: Std(value) for rank, value in spec.per_rank}
    return Std(spec.default)


def hooks_reachable(cfg: LaunchConfig, environ: Mapping[str, str]) -> LaunchConfig:
    """``cfg`` for an interpreter that can run the worker hooks. ``PYTHON_EXEC`` may name another
    environment's Python (its own torch: why people set it) without unicron: its workers then
    start as torchrun starts them, as with --no-inject, and the user is told once, rather than
    every rank failing on ``No module named 'unicron'`` until the budget is spent."""
    if not cfg.uses_boot or os.path.realpath(cfg.python_exec) == os.path.realpath(sys.executable):
        return cfg
    try:
        probe = subprocess.run([cfg.python_exec, "-c", "import unicron.worker.boot"], env=dict(environ),
                               stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UsageError(f"PYTHON_EXEC {cfg.python_exec!r} cannot be run: {err}") from None
    if probe.returncode == 0:
        return cfg
    why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
    if cfg.injects:
        raise UsageError(f"--inject needs unicron's worker hooks, which PYTHON_EXEC {cfg.python_exec} cannot "
                         f"import ({why})")
    note = (f"PYTHON_EXEC {cfg.python_exec} cannot import unicron's worker hooks ({why}): its workers start "
            "as under torchrun, as with --no-inject (no step reports, no stacks of a hang, no warm restarts; "
            "install unicron in that environment for them)")
    return replace(cfg, no_inject=True, warm=False, warnings=(*cfg.warnings, note))


def settings_from_config(cfg: LaunchConfig) -> AgentSettings:
    cfg = hooks_reachable(cfg, os.environ)
    base_env = dict(os.environ)
    run_id = cfg.rdzv_id

    def env_for(*, local_rank: int, rank: int, world_size: int, group_rank: int, group_world_size: int,
                local_world_size: int, role_rank: int, role_world_size: int, master_addr: str,
                master_port: int, restart_count: int, error_file: str) -> Mapping[str, str]:
        return worker_env(base_env, cfg=cfg, local_rank=local_rank, rank=rank, world_size=world_size,
                          local_world_size=local_world_size, group_rank=group_rank,
                          group_world_size=group_world_size, role_rank=role_rank,
                          role_world_size=role_world_size, master_addr=master_addr, master_port=master_port,
                          restart_count=restart_count, run_id=run_id, error_file=error_file, extra={})

    return AgentSettings(
        run_id=run_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        nproc=cfg.nproc_per_node,
        node_rank=cfg.node_rank,
        max_restarts=cfg.max_restarts,
        role=cfg.role,
        # Workers reach the store where the coordinator runs: a standalone one's host, else the endpoint's.
        rdzv_host=cfg.coordinator.rpartition(":")[0].strip("[]") if cfg.coordinator else cfg.rdzv_host,
        rdzv_port=cfg.rdzv_port,
        embed_coordinator=cfg.coordinator is None,
        coordinator=cfg.coordinator,
        local_addr=cfg.local_addr or socket.gethostname(),
        advertise_addr=master_addr_for(cfg, fqdn=socket.getfqdn()),
        log_spec=LogSpec(log_dir=cfg.log_dir, redirects=_std(cfg.redirects), tee=_std(cfg.tee),
                         local_ranks_filter=cfg.local_ranks_filter, prefix_template=cfg.log_line_prefix_template,
                         duplicate_stdout_filters=cfg.duplicate_stdout_filters,
                         duplicate_stderr_filters=cfg.duplicate_stderr_filters),
        cmd=tuple(worker_command(cfg, inject=True)),
        inject=cfg.inject_env,
        grace_s=cfg.grace_period,
        monitor_interval_s=cfg.monitor_interval,
        hang_factor=cfg.hang_factor,
        hang_floor_s=cfg.hang_floor,
        hang_warmup_steps=cfg.hang_warmup_steps,
        hang_busy_factor=cfg.hang_busy_factor,
        hang_busy_floor_s=cfg.hang_busy_floor,
        first_step_timeout_s=cfg.first_step_timeout,
        heartbeat_interval_s=cfg.heartbeat_interval,
        heartbeat_timeout_s=cfg.heartbeat_timeout,
        last_call_s=cfg.rdzv_conf.last_call_timeout,
        join_timeout_s=cfg.rdzv_conf.join_timeout,
        secret=cfg.secret,
        secret_file=cfg.secret_file,
        secret_generated=cfg.secret_source == "generated",
        weight=cfg.weight,
        status_line=cfg.status_line,
        metrics_port=cfg.metrics_port,
        worker_env=env_for,
        warm=cfg.warm,
        is_host=cfg.rdzv_conf.is_host,
        signals=tuple(_signum(name) for name in cfg.signals_to_handle),
        warnings=cfg.warnings,
    )


def _signum(name: str) -> int:
    import signal

    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))
