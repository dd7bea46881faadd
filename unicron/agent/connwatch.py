"""Whether the agent's connection to its coordinator is open: the ZeroMQ socket monitor of its
DEALER (a PAIR socket the agent polls with the rest), reduced to up or down. It tells a
coordinator whose process died (its host's kernel closed the connection) from one that lives
but is silent (``unicron.agent.link``)."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

# A session is up once the ZMTP handshake is done: a TCP connect alone also succeeds to a port
# whose process is stopped (the kernel accepts it into the listen backlog).
UP = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
DOWN = zmq.EVENT_DISCONNECTED


class ConnectionWatch:
    def __init__(self, dealer: zmq.Socket) -> None:
        """Watch ``dealer``; call before it connects, so the first session is seen."""
        self.dealer = dealer
        self.sock = dealer.get_monitor_socket(UP | DOWN)

    def read(self) -> bool | None:
        """Drain the monitor: whether the session is up after the events seen (None: none)."""
        state = None
        while True:
            try:
                event = recv_monitor_message(self.sock, zmq.NOBLOCK)
            except zmq.Again:
                return state
            except zmq.ZMQError:  # the monitor is closing
                return state
            state = event.get("event") == UP

    def close(self) -> None:
        try:
            self.dealer.disable_monitor()
        except zmq.ZMQError:
            pass
        self.sock.close(linger=0)
