"""Leaving a node out of a job: what a reconfigure does when its root cause points at a node
that is still there (it failed again in place after a restart; a GPU hardware fault).

The node is told why and ends (its agent exits with the reason); a join from it later is
refused with the same reason, so it cannot come back as a late joiner and fail the job again.
Its agent started again (a new node id) is a new node, admitted like any other.
"""

from __future__ import annotations

from typing import Any

from unicron.coord.membership import Membership, NodeState
from unicron.coord.outbox import Emit, Out, Send


def leave_out(members: Membership, excluded: dict[str, str], job_id: str, node_ids: Any,
              reason: str) -> list[Out]:
    """Take ``node_ids`` out of ``members`` (recording why in ``excluded``) and tell them."""
    out: list[Out] = []
    first_line = reason.splitlines()[0] if reason else "it failed again in place"
    for node_id in node_ids:
        gone = members.leave(node_id, NodeState.EXCLUDED)
        if gone is None:
            continue
        why = f"left out of job {job_id}: {first_line}"
        excluded[node_id] = why
        out.append(Emit("node_excluded", {"node_id": node_id, "host": gone.host, "reason": first_line}))
        out.append(Send(node_id, "reject", {"reason": why}))
    return out
