"""Is a host there? TCP connects from a daemon thread, only while someone asks.

Two questions use it. An agent whose coordinator is silent over an open connection asks whether
the coordinator's host still accepts connections on its port (``unicron.agent.hostprobe``: a
refusal means nothing listens). A coordinator that hears none of its nodes asks whether any of
their hosts answers at all (``unicron.coord.hearing``: a refusal crossed the network too).
The thread connects and closes at once (a ZeroMQ socket on the port sees a peer that never
greets, and drops it).
"""

from __future__ import annotations

import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable, Collection

Address = tuple[str, int]
_ANSWERS = (0, errno.ECONNREFUSED)  # a handshake, or a refusal: the host's kernel answered


def connects(address: Address, timeout_s: float) -> bool:
    """Whether ``address`` accepts a connection within ``timeout_s``."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, timed out, a name that does not resolve
        return False


def hosts_answer(addresses: Collection[Address], timeout_s: float) -> bool:
    """Whether any host of ``addresses`` answers a TCP connect (a handshake or a refusal) within
    ``timeout_s`` in all, tried at once. Unreachable, timed out or unresolvable is no answer."""
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    try:
        for host, port in addresses:
            try:
                family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
            except OSError:
                continue
            socks.append(sock)
            sock.setblocking(False)
            code = sock.connect_ex(sockaddr)
            if code in _ANSWERS:
                return True
            if code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                sel.register(sock, selectors.EVENT_WRITE)
        while sel.get_map():
            remaining = deadline - time.monotonic()
            ready = sel.select(remaining) if remaining > 0 else []
            if not ready:
                return False
            for key, _ in ready:
                done: socket.socket = key.fileobj  # type: ignore[assignment]
                if done.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in _ANSWERS:
                    return True
                sel.unregister(done)
        return False
    finally:
        sel.close()
        for sock in socks:
            sock.close()


class Prober:
    """Asks ``answer(addresses, timeout_s)`` every ``every_s`` while it has addresses, and
    records when the last probe that got an answer started (``clock``'s time: the network
    worked after it), and the last that got none."""

    def __init__(self, answer: Callable[[Collection[Address], float], bool], *, clock: Callable[[], float],
                 every_s: float, timeout_s: float) -> None:
        self._answer, self.clock, self.every_s, self.timeout_s = answer, clock, every_s, timeout_s
        self.answered_at: float | None = None
        self.unanswered_at: float | None = None  # when the last probe that got no answer started
        self.probes = 0
        self._addresses: frozenset[Address] = frozenset()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def want(self, addresses: Collection[Address]) -> None:
        """Probe these from now on (none: stop once the probe in flight ends). Said as often as
        the caller likes: it sets no faster pace. The thread starts at the first want."""
        with self._lock:
            was, self._addresses = self._addresses, frozenset(addresses)
        if not addresses or self._closed:
            return
        if not was:
            self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unicron-probe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.clear()  # a want after this wakes the wait below
            with self._lock:
                addresses = self._addresses
            if not addresses:
                self._wake.wait()
                continue
            started = self.clock()
            self.probes += 1
            if self._answer(addresses, self.timeout_s):
                self.answered_at = started
            else:
                self.unanswered_at = started
            self._wake.wait(max(0.0, self.every_s - (self.clock() - started)))

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread is not None:  # a connect in flight ends within timeout_s; a daemon needs no more wait
            self._thread.join(0.5)
