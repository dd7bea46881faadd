"""From the coordinator's ``assign`` to what a node's workers are started with: the group's
layout, its hang detector and each worker's environment (torchrun's variables, then the agent's
own ``UNICRON_*`` channel to it); what the user is told when they start; and what a ``stop``
is answered with."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from unicron.agent.ranks import GroupSpec
from unicron.agent.settings import AgentSettings
from unicron.agent.workers import WorkerGroup
from unicron.detect.hang import HangDetector
from unicron.errors import UsageError
from unicron.worker.inject import parse_inject_spec


def group_spec(body: dict[str, Any], s: AgentSettings) -> GroupSpec:
    """The layout ``assign`` gives this node; faults are injected into the first attempt only."""
    return GroupSpec(attempt=body["attempt"], restart_count=body["restart_count"],
                     rank_offset=body["rank_offset"], world_size=body["world_size"],
                     node_rank=body["node_rank"], nnodes=body["nnodes"],
                     local_world_sizes=tuple(body["local_world_sizes"]),
                     master_addr=body["master_addr"] or s.rdzv_host, master_port=body["master_port"],
                     restore_step=body.get("restore_step"), inject=injected(body, s),
                     restore_note=body.get("restore_note", ""),
                     node_ids=frozenset(str(n[0]) for n in body.get("nodes", ()) if isinstance(n, list) and n),
                     **role_ranks(body))


def role_ranks(body: dict[str, Any]) -> dict[str, int]:
    """Where this node's workers stand among the workers of their ``--role`` (``assign``'s
    ``roles``, one per node in node-rank order), as torchrun gives ROLE_RANK and ROLE_WORLD_SIZE:
    the workers of nodes of the same role before it, and all of them (acceptance 25B F1: the
    global rank and world size, whatever the roles). Empty when the coordinator sent none."""
    roles, sizes, me = body.get("roles"), body["local_world_sizes"], body["node_rank"]
    if not isinstance(roles, list) or len(roles) != len(sizes) or not 0 <= me < len(sizes):
        return {}
    mine = [i for i, role in enumerate(roles) if role == roles[me]]
    return {"role_offset": sum(sizes[i] for i in mine if i < me), "role_world_size": sum(sizes[i] for i in mine)}


class EarlierAttempts:
    """What this node's attempts so far showed of the script, for the next one's hang detector."""

    def __init__(self) -> None:
        self.steps_seen = False  # some attempt's workers reported steps: the script steps
        # The latest attempt's time to every local rank's first step, and its layout: world
        # size and nodes.
        self._startup: tuple[float, int, frozenset[str]] | None = None

    def ended(self, group: WorkerGroup) -> None:
        self.steps_seen = self.steps_seen or any(r.steps_in_attempt for r in group.ranks.values())
        startup = group.hang.stats.startup_s()
        if startup is not None:
            self._startup = (startup, group.spec.world_size, group.spec.node_ids)

    def startup_hint(self, spec: GroupSpec) -> float | None:
        """The start-up an attempt of ``spec``'s layout took before; None after a change of
        layout: another world size, or another node in place of one (a replacement starts cold,
        its interpreter and imports to come, and its ranks' peers wait for it)."""
        if self._startup is None or self._startup[1:] != (spec.world_size, spec.node_ids):
            return None
        return self._startup[0]


def injected(body: dict[str, Any], s: AgentSettings) -> str:
    """What ``assign`` injects: in the first attempt only, every node's ``--inject`` (this
    node's if the coordinator sent none, or what it sent does not parse)."""
    if not body["inject"]:
        return ""
    faults = body.get("inject_faults") or s.inject
    try:
        if faults:
            parse_inject_spec(faults)
    except UsageError:
        return s.inject
    return faults


def hang_detector(s: AgentSettings, startup_hint_s: float | None = None) -> HangDetector:
    """``startup_hint_s``: how long an earlier attempt on this node took to its ranks' first step."""
    return HangDetector(k=s.hang_factor, floor_s=s.hang_floor_s, warmup_steps=s.hang_warmup_steps,
                        first_step_timeout_s=s.first_step_timeout_s, busy_k=s.hang_busy_factor,
                        busy_floor_s=s.hang_busy_floor_s, startup_hint_s=startup_hint_s)


def worker_env_factory(s: AgentSettings, spec: GroupSpec, *, agent_addr: str, stack_dir: str,
                       shm_dir: str, watch_start_s: float | None = None) -> Callable[[int, int, str], dict[str, str]]:
    """``watch_start_s``: from when the hang detector gathers the start-up's activity."""
    nproc = spec.local_world_sizes[spec.node_rank]

    def env_for(local_rank: int, rank: int, error_file: str) -> dict[str, str]:
        env = dict(s.worker_env(local_rank=local_rank, rank=rank, world_size=spec.world_size,
                                group_rank=spec.node_rank, group_world_size=spec.nnodes,
                                local_world_size=nproc,
                                role_rank=rank if spec.role_offset is None else spec.role_offset + local_rank,
                                role_world_size=spec.role_world_size or spec.world_size,
                                master_addr=spec.master_addr, master_port=spec.master_port,
                                restart_count=spec.restart_count, error_file=error_file))
        env.update({"UNICRON_AGENT_ADDR": agent_addr, "UNICRON_STACK_DIR": stack_dir,
                    "UNICRON_SNAPSHOT_DIR": shm_dir, "UNICRON_AGENT_PID": str(os.getpid())})
        if spec.restore_step is not None:
            env["UNICRON_RESTORE_STEP"] = str(spec.restore_step)
        if spec.inject:
            env["UNICRON_INJECT"] = spec.inject
        if watch_start_s is not None:
            env["UNICRON_WATCH_START"] = f"{watch_start_s:.3f}"
        env["UNICRON_HANG_IDLE"] = f"{s.hang_factor:g},{s.hang_floor_s:g}"
        return env

    return env_for


def attempt_line(spec: GroupSpec, ranks: list[int]) -> str:
    """The user's line for an attempt whose workers start on this node."""
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {min(ranks)}-{max(ranks)}"  # not "ranks 0-0" (28C F10)
    what = f"attempt {spec.attempt}: {span} of {spec.world_size}"
    if spec.restore_step is not None:
        what += f", restoring step {spec.restore_step} from memory"
    elif spec.restore_note:
        what += f", from the script's own start: {spec.restore_note}"
    return what


def inject_warnings(spec: GroupSpec, *, hooked: bool = True) -> list[str]:
    """``--inject`` faults that would never fire: aimed at ranks the job does not have (said on
    node 0 only, once per job, now that the world size is known), or at this node's ranks when
    it starts them without unicron's hooks (``hooked`` False: --no-inject; another node's
    --inject named them, acceptance 26A F3)."""
    if not spec.inject:
        return []
    faults = parse_inject_spec(spec.inject)
    out = [f"--inject {fault}: rank {fault.rank} does not exist (world size {spec.world_size}); it never fires"
           for fault in faults if spec.node_rank == 0 and fault.rank is not None and fault.rank >= spec.world_size]
    mine = range(spec.rank_offset, spec.rank_offset + spec.local_world_sizes[spec.node_rank])
    for fault in faults if not hooked else ():
        if ranks := [r for r in mine if fault.applies_to(r)]:
            out.append(f"--inject {fault} never fires on rank(s) {', '.join(map(str, ranks))}: this node starts "
                       "its workers without unicron's hooks (--no-inject)")
    return out


def unfired_injects(spec: GroupSpec, steps: dict[int, int], faulted: set[int | None]) -> list[str]:
    """``--inject`` faults for this node's ranks (``steps``: rank -> completed steps when the
    first attempt's workers stopped) that never fired: the rank stopped before their step (an
    earlier fault ended the attempt, or the script ended), and faults are injected into the first
    attempt only. A rank with a fault of its own (``faulted``; None: a hang of the node), or the
    target of a ``freeze``, may have stopped before the report of its last step left it: it gets
    a step of slack."""
    if spec.attempt != 0 or not spec.inject:
        return []
    out = []
    for fault in parse_inject_spec(spec.inject):
        short = sorted((rank, step) for rank, step in steps.items() if fault.applies_to(rank)
                       and step + (rank in faulted or None in faulted or fault.kind == "freeze") < fault.step)
        if fault.step > 0 and short:
            rank, step = short[0]
            out.append(f"--inject {fault} did not fire: rank {rank} stopped at step {step} of the first attempt "
                       "(faults are injected into the first attempt only)")
    return out


def stop_answer(group: WorkerGroup, want_stacks: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                 dict[str, str]]:
    """Before a stopped attempt's workers are killed: the faults of ranks that already died
    (often the root cause, e.g. a SIGKILLed rank, while its peers' exceptions only echo it), the
    ranks that had ended cleanly (when the others then lost their peers, that is why), and every
    live rank's stack if the coordinator asked."""
    faults = group.settle_dying()
    # A script that ended with sys.exit(0) has closed its sockets (its peers fail at once) while its
    # interpreter may still be tearing down: it said bye, so it counts as ended cleanly too; so
    # does one that destroyed its process group (``closed``), which its peers' collectives
    # fail on before it even gets to its exit.
    finished = [{"rank": r.rank, "step": r.step} for r in group.ranks.values()
                if r.exitcode == 0 or (r.exitcode is None and (r.bye_at is not None or r.closed_cleanly))]
    return faults, finished, group.dump_stacks() if want_stacks else {}
