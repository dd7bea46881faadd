"""From the coordinator's ``assign`` to what a node's workers are started with: the group's
layout, its hang detector and each worker's environment (torchrun's variables, then the agent's
own ``UNICRON_*`` channel to it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from unicron.agent.settings import AgentSettings
from unicron.agent.workers import GroupSpec
from unicron.detect.hang import HangDetector


def group_spec(body: dict[str, Any], s: AgentSettings) -> GroupSpec:
    """The layout ``assign`` gives this node; faults are injected into the first attempt only."""
    return GroupSpec(attempt=body["attempt"], restart_count=body["restart_count"],
                     rank_offset=body["rank_offset"], world_size=body["world_size"],
                     node_rank=body["node_rank"], nnodes=body["nnodes"],
                     local_world_sizes=tuple(body["local_world_sizes"]),
                     master_addr=body["master_addr"] or s.rdzv_host, master_port=body["master_port"],
                     restore_step=body.get("restore_step"), inject=s.inject if body["inject"] else "",
                     restore_note=body.get("restore_note", ""))


def hang_detector(s: AgentSettings) -> HangDetector:
    return HangDetector(k=s.hang_factor, floor_s=s.hang_floor_s, warmup_steps=s.hang_warmup_steps,
                        first_step_timeout_s=s.first_step_timeout_s, busy_k=s.hang_busy_factor,
                        busy_floor_s=s.hang_busy_floor_s)


def worker_env_factory(s: AgentSettings, spec: GroupSpec, *, agent_addr: str, stack_dir: str,
                       shm_dir: str) -> Callable[[int, int, str], dict[str, str]]:
    nproc = spec.local_world_sizes[spec.node_rank]

    def env_for(local_rank: int, rank: int, error_file: str) -> dict[str, str]:
        env = dict(s.worker_env(local_rank=local_rank, rank=rank, world_size=spec.world_size,
                                group_rank=spec.node_rank, group_world_size=spec.nnodes,
                                local_world_size=nproc, role_rank=rank, role_world_size=spec.world_size,
                                master_addr=spec.master_addr, master_port=spec.master_port,
                                restart_count=spec.restart_count, error_file=error_file))
        env.update({"UNICRON_AGENT_ADDR": agent_addr, "UNICRON_STACK_DIR": stack_dir,
                    "UNICRON_SNAPSHOT_DIR": shm_dir, "UNICRON_AGENT_PID": str(os.getpid())})
        if spec.restore_step is not None:
            env["UNICRON_RESTORE_STEP"] = str(spec.restore_step)
        if spec.inject:
            env["UNICRON_INJECT"] = spec.inject
        return env

    return env_for
