"""A job as the coordinator's server holds it: its core, its event log, and where its nodes are
reached (the sockets they were heard from)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unicron.coord.job import JobCore
from unicron.coord.stores import AttemptStores
from unicron.events import EventLog

# What a node must get even when its latest message came over another socket: one signed
# message from a socket of someone holding the secret took a node's stop and assign, and the
# job ended "failed" while its workers trained on, or hung after training (acceptance 30B F1).
# A node's earlier socket is gone once it re-dialed (ZeroMQ drops what is sent to it).
ORDERS = frozenset({"stop", "assign", "shutdown", "reject"})
EARLIER_KEPT = 2


def rebind(slot: JobSlot, node_id: str, identity: bytes) -> None:
    """Answer ``node_id`` on ``identity`` from now on, keeping its earlier sockets for orders."""
    current = slot.identities.get(node_id)
    if current is not None and current != identity:
        kept = [i for i in slot.earlier.get(node_id, []) if i not in (current, identity)]
        slot.earlier[node_id] = [current, *kept][:EARLIER_KEPT]
    slot.identities[node_id] = identity


@dataclass
class JobSlot:
    core: JobCore
    events: EventLog
    identities: dict[str, bytes] = field(default_factory=dict)
    earlier: dict[str, list[bytes]] = field(default_factory=dict)  # a node's sockets before its latest
    stores: AttemptStores = field(default_factory=AttemptStores)
    finished_at: float | None = None
