"""Does the coordinator's host still accept connections on its port? (TCP connects from a thread,
only while the agent asks)

A coordinator silent over an open ZeroMQ connection is either alive but not answering (its
process stopped, swapping, its launcher frozen by a debugger: its host's kernel still completes
TCP handshakes on the port, into the listen backlog) or cut off (a partition, its host frozen
whole or gone: nothing answers, and no kernel says that the connection closed). Only the first
is worth the long wait (``unicron.agent.link``). While the agent asks (``want``), a daemon thread
connects to the coordinator's port every ``every_s`` with a ``timeout_s`` timeout and closes at
once (the coordinator's ZeroMQ sees a peer that never greets and drops it), and records when a
connect last succeeded. A refused connect is no answer: nothing listens there.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

EVERY_S = 1.0
TIMEOUT_S = 2.0


def tcp_address(endpoint: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` endpoint (IPv6 in brackets); None for any other."""
    if not endpoint.startswith("tcp://"):
        return None
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def connects(address: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:  # refused, unreachable, timed out, a name that does not resolve
        return False


class HostProbe:
    def __init__(self, endpoint: str, *, every_s: float = EVERY_S, timeout_s: float = TIMEOUT_S,
                 connect: Callable[[tuple[str, int], float], bool] = connects) -> None:
        self.address = tcp_address(endpoint)
        self.every_s, self.timeout_s, self._connect = every_s, timeout_s, connect
        self.answered_at: float | None = None  # monotonic: the last connect that succeeded
        self.probes = 0
        self._wanted = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, on: bool) -> None:
        """Probe (from now on, until told otherwise) or stop probing; the thread starts at the
        first want and sleeps while not wanted."""
        if not on:
            self._wanted.clear()
            return
        if self.address is None or self._closed.is_set():
            return
        self._wanted.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unicron-hostprobe", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self.address is not None
        while not self._closed.is_set():
            self._wanted.wait()
            if self._closed.is_set():
                return
            started = time.monotonic()
            self.probes += 1
            if self._connect(self.address, self.timeout_s):
                self.answered_at = time.monotonic()
            self._closed.wait(max(0.0, self.every_s - (time.monotonic() - started)))

    def close(self) -> None:
        self._closed.set()
        self._wanted.set()  # wake the thread to see it is closed
        if self._thread is not None:  # a connect in flight ends within timeout_s; a daemon needs no more wait
            self._thread.join(0.5)
