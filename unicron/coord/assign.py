"""What the coordinator says when an attempt starts (pure): the ``attempt_start`` event and
each node's ``assign``, its place in the attempt's world."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from unicron.coord.outbox import Emit, Out, Send


class Placed(Protocol):
    """A member of the attempt, ranked (``Membership.assign_ranks``)."""

    node_id: str
    host: str
    nproc: int
    node_rank: int


def attempt_messages(number: int, nodes: Sequence[Placed], *, epoch: int, restarts_used: int,
                     master_addr: str, master_port: int, restore_step: int | None,
                     restore_note: str = "", why: str = "", started_at: float | None = None,
                     restarts: Sequence[dict[str, Any]] = (), inject: str = "",
                     roles: Sequence[str] = ()) -> list[Out]:
    """The event that opens attempt ``number`` on ``nodes`` (in node-rank order), then one
    ``assign`` per node: its node rank, the global rank of its first worker, the world's sizes,
    the store, the step every rank restores, ``why`` (the decision that led to it, for the
    console of every node: only the one hosting the coordinator sees its events), and the
    faults the first attempt injects (``inject``: those of every node, see ``merged_injects``),
    and each node's ``--role`` (``roles``, in node-rank order: its workers' ROLE_RANK counts
    within it, as torchrun's do)."""
    sizes = [n.nproc for n in nodes]
    world = sum(sizes)
    note: dict[str, Any] = {"restore_note": restore_note} if restore_note else {}
    out: list[Out] = [Emit("attempt_start", {
        "attempt": number, "world_size": world, "nnodes": len(nodes), "epoch": epoch,
        "master_port": master_port, "restore_step": restore_step, **note,
        "nodes": {n.node_id: n.node_rank for n in nodes}})]
    offset = 0
    for node in nodes:
        out.append(Send(node.node_id, "assign", {
            "epoch": epoch, "attempt": number,
            # TORCHELASTIC_RESTART_COUNT, as torchrun counts it: the failures restarted
            # (job-wide), not re-formations that admitted a node
            "restart_count": restarts_used,
            "node_rank": node.node_rank, "nnodes": len(nodes), "rank_offset": offset,
            "world_size": world, "local_world_sizes": sizes, "master_addr": master_addr,
            "master_port": master_port, "restore_step": restore_step, **note,
            **({"why": why} if why else {}),
            # faults are injected into the first attempt only (a restart must be able to heal)
            "inject": number == 0, **({"inject_faults": inject} if inject and number == 0 else {}),
            "restarts_used": restarts_used, **({"roles": list(roles)} if len(roles) == len(nodes) else {}),
            "nodes": [[n.node_id, n.host] for n in nodes],
            **({"started_at": started_at} if started_at is not None else {}),
            "restarts": list(restarts)}))
        offset += node.nproc
    return out


def merged_injects(specs: Iterable[str]) -> str:
    """The ``--inject`` faults of every node, each once (``KIND@RANK:STEP;...``): a RANK is a
    global rank, and a node applies those of its own ranks, whichever node was given them
    (acceptance 25C F3: a fault given on another node than its rank's never fired, unsaid)."""
    parts = (part.strip() for spec in specs for part in spec.split(";"))
    return ";".join(dict.fromkeys(part for part in parts if part))
