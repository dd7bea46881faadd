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
second (``unicron.agent.workers``), on the agent's loop thread, so the cost must not grow with
the host: each of the rank's own sockets is asked (a duplicate of its descriptor, taken with
``pidfd_getfd``, and ``SIOCOUTQ``), whatever else the network namespace holds. The table
(tens of MB on a host with tens of thousands of sockets, TIME_WAIT ones included: seconds to
read and parse) is read only where the kernel does not let the agent take a descriptor
(ptrace rules, seccomp), and only while it is small.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
import termios
import time
from collections.abc import Callable, Mapping

TCP_TABLES = ("tcp", "tcp6")
TABLE_MAX_BYTES = 1 << 20  # about 6,500 sockets: larger tables are not read (no evidence from them)
TABLE_FRESH_S = 0.2  # one reading of a namespace's table serves every rank sampled meanwhile
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture (5.6+)
_NOT_ALLOWED = (errno.EPERM, errno.EACCES, errno.ENOSYS, errno.EINVAL)


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
    return set(socket_fds(pid).values())


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


class NotAllowed(Exception):
    """The kernel does not let this process take another's descriptors."""


def socket_fds(pid: int) -> dict[int, int]:
    """Descriptor -> inode of each socket ``pid`` has open (empty when it is gone or not readable)."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]") and fd.isdigit():
            try:
                found[int(fd)] = int(target[8:-1])
            except ValueError:
                continue
    return found


def asked_send_queues(pid: int) -> dict[int, int]:
    """Inode -> unsent bytes of each TCP socket of ``pid``, asked of the sockets themselves.
    Raises NotAllowed where descriptors cannot be taken (then read the table)."""
    fds = socket_fds(pid)
    if not fds:
        return {}
    if _LIBC is None or not hasattr(os, "pidfd_open"):
        raise NotAllowed("no pidfd_getfd here")
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as err:
        if err.errno in _NOT_ALLOWED:
            raise NotAllowed(err.strerror) from None
        return {}  # gone
    queues: dict[int, int] = {}
    try:
        for fd, inode in fds.items():
            taken = _LIBC.syscall(ctypes.c_long(SYS_PIDFD_GETFD), ctypes.c_int(pidfd), ctypes.c_int(fd),
                                  ctypes.c_uint(0))
            if taken < 0:
                code = ctypes.get_errno()
                if code in (errno.EPERM, errno.EACCES, errno.ENOSYS):
                    raise NotAllowed(os.strerror(code))
                if code == errno.ESRCH:
                    return {}
                continue  # EBADF: closed meanwhile
            try:
                queued = _tcp_unsent(taken)
            finally:
                os.close(taken)
            if queued is not None:
                queues[inode] = queued
    finally:
        os.close(pidfd)
    return queues


def _tcp_unsent(fd: int) -> int | None:
    """SIOCOUTQ of a TCP socket (bytes written and not yet acknowledged); None for any other kind."""
    try:
        sock = socket.socket(fileno=fd)  # reads its family and type; detached below, never closed
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0" * 4))[0])
    except OSError:
        return None
    finally:
        sock.detach()


def table_send_queues(pid: int, inodes: set[int] | None, max_bytes: int = TABLE_MAX_BYTES) -> dict[int, int] | None:
    """Send queue of each of ``inodes`` (None: every socket) from ``pid``'s namespace tables;
    None when a table is over ``max_bytes`` (not read: too costly to parse a few times a second)."""
    queues: dict[int, int] = {}
    for table in TCP_TABLES:
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as fh:
                raw = fh.read(max_bytes + 1)
        except OSError:
            continue  # no IPv6, or the process is gone
        if len(raw) > max_bytes:
            return None
        queues.update({inode: tx for inode, tx in parse_tcp_table(raw.decode("ascii", "replace")).items()
                       if inodes is None or inode in inodes})
    return queues


class SendQueueWatch:
    """Cumulative bytes drained from each watched process's send queues, reading by reading (one
    per attempt's worker group: its processes do not change)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, route: str = "ask",
                 table_max_bytes: int = TABLE_MAX_BYTES) -> None:
        self._last: dict[int, dict[int, int]] = {}
        self._drained: dict[int, int] = {}
        self.clock = clock
        self.route = route  # "ask" the sockets; "table" where not allowed; "none": the table is too big
        self.table_max_bytes = table_max_bytes
        self._tables: dict[int, tuple[float, dict[int, int]]] = {}  # netns inode -> (read at, all queues)

    def drained(self, pid: int) -> int:
        """Read ``pid``'s send queues now; bytes drained since it was first read."""
        now = self._read(pid)
        total = self._drained.get(pid, 0) + drained_between(self._last.get(pid, {}), now)
        self._last[pid], self._drained[pid] = now, total
        return total

    def _read(self, pid: int) -> dict[int, int]:
        if self.route == "ask":
            try:
                return asked_send_queues(pid)
            except NotAllowed:
                self.route = "table"
        if self.route != "table":
            return {}
        inodes = socket_inodes(pid)
        if not inodes:
            return {}
        try:
            netns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return {}
        cached = self._tables.get(netns)
        if cached is None or self.clock() - cached[0] > TABLE_FRESH_S:
            table = table_send_queues(pid, None, self.table_max_bytes)
            if table is None:
                self.route = "none"  # for this attempt: a host this busy stays busy
                return {}
            cached = self._tables[netns] = (self.clock(), table)
        return {inode: tx for inode, tx in cached[1].items() if inode in inodes}

