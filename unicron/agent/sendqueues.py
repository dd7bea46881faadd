"""Bytes a worker's TCP sockets hand to the network while it waits (activity evidence).

A collective over a slow link looks idle by every other counter: gloo's ``writev`` puts a
chunk into the kernel's send buffer at once (``wchar`` counts it then), the buffer then drains
at the link's rate for seconds, and gloo's receives (``recv``) are counted nowhere. What does
move is each socket's send queue (bytes written and not yet acknowledged by the peer, the
``tx_queue`` of ``/proc/PID/net/tcp``): it shrinks as the peer acknowledges. A hung collective
drains nothing: the waiting ranks' data is acknowledged already, and a stopped peer's receive
buffer fills within milliseconds on any link fast enough to train over.

Only the worker process's own sockets count, not its helpers' (an upload by a logging service
process is not the job's progress). Read only while a job is overdue for a step, a few times a
second (``unicron.agent.workers``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TCP_TABLES = ("tcp", "tcp6")


def parse_tcp_table(text: str) -> dict[int, int]:
    """Send queue (bytes) of each socket inode in a ``/proc/net/tcp``-format table (pure).

    Lines are ``sl local remote st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...``;
    a line that does not parse is skipped (the kernel's format is stable, but a reader must not
    fail the detector over one)."""
    queues: dict[int, int] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        try:
            tx = int(fields[4].partition(":")[0], 16)
            inode = int(fields[9])
        except ValueError:
            continue
        if inode:
            queues[inode] = tx
    return queues


def drained_between(before: Mapping[int, int], after: Mapping[int, int]) -> int:
    """Bytes that left the send queues between two readings (pure): what each socket still in
    both readings lost. New data written meanwhile hides some drain, never adds any; a socket
    opened or closed in between counts nothing."""
    return sum(max(0, tx - after[inode]) for inode, tx in before.items() if inode in after)


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` has open (empty when it is gone or not readable)."""
    inodes: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                inodes.add(int(target[8:-1]))
            except ValueError:
                continue
    return inodes


def send_queues(pid: int) -> dict[int, int]:
    """Send queue of each TCP socket ``pid`` has open, from its network namespace's tables."""
    mine = socket_inodes(pid)
    if not mine:
        return {}
    queues: dict[int, int] = {}
    for table in TCP_TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}") as fh:
                text = fh.read()
        except OSError:
            continue  # no IPv6, or the process is gone
        queues.update({inode: tx for inode, tx in parse_tcp_table(text).items() if inode in mine})
    return queues


class SendQueueWatch:
    """Cumulative bytes drained from each watched process's send queues, reading by reading (one
    per attempt's worker group: its processes do not change)."""

    def __init__(self) -> None:
        self._last: dict[int, dict[int, int]] = {}
        self._drained: dict[int, int] = {}

    def drained(self, pid: int) -> int:
        """Read ``pid``'s send queues now; bytes drained since it was first read."""
        now = send_queues(pid)
        total = self._drained.get(pid, 0) + drained_between(self._last.get(pid, {}), now)
        self._last[pid], self._drained[pid] = now, total
        return total
