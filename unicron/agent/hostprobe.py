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

import time
from collections.abc import Callable

from unicron.netprobe import Address, Prober, connects

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


class HostProbe:
    """The coordinator's endpoint, probed (``unicron.netprobe``) while the agent asks; only an
    accepted connection is an answer."""

    def __init__(self, endpoint: str, *, every_s: float = EVERY_S, timeout_s: float = TIMEOUT_S,
                 connect: Callable[[Address, float], bool] = connects) -> None:
        self.address = tcp_address(endpoint)
        self.prober = Prober(lambda addresses, t: any(connect(a, t) for a in addresses),
                             clock=time.monotonic, every_s=every_s, timeout_s=timeout_s)

    @property
    def answered_at(self) -> float | None:
        """Monotonic: when the last probe that got an answer started."""
        return self.prober.answered_at

    @property
    def probes(self) -> int:
        return self.prober.probes

    def want(self, on: bool) -> None:
        """Probe (from now on, until told otherwise) or stop probing."""
        self.prober.want({self.address} if on and self.address is not None else ())

    def close(self) -> None:
        self.prober.close()
