"""The worker's one-way channel to its agent: JSON messages on a ZeroMQ PUSH socket.

Messages (``t`` is the type; see docs/architecture.md, "Worker <-> agent"):
``hello{rank,local_rank,pid,ts}``, ``step{rank,step,ts}``, ``exc{rank,type,msg,tb,fatal,ready,ts}``,
``snap{rank,step,bytes,ts}``, ``moved{rank,ts}``, ``data{rank,ts}``, ``ready{rank,ts}``, ``optim{rank,ts}``,
``exiting{rank,code,ready,ts}``, ``closed{rank,ts}`` (the default process group was destroyed), ``opened{rank,ts}`` (a new one is
being made after that),
``bye{rank,ts}``.

The agent reads this channel in batches (at most every 0.1 s: a step message per step would
otherwise wake it dozens of times a second). A message that cannot wait for the batch
(``URGENT``: an exception, an announced exit) also rings the agent's doorbell, an empty
message on a second socket at ``bell_address(addr)`` that the agent always listens to; the
message itself still goes through this channel, so the agent reads everything in the order it
was sent.

Training must never wait for the agent: every send is non-blocking, and a message that does
not fit under the high-water mark (agent slow or gone) is dropped and counted. The socket is
closed at exit with a short linger, so an ``exc`` sent just before the process dies still
reaches the agent. Without ``UNICRON_AGENT_ADDR`` (plain python/torchrun) the channel is a
no-op. zmq sockets do not survive ``fork``: in a forked child the channel is inert.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from unicron.worker import env

SEND_HWM = 10_000  # messages queued for a slow agent before we start dropping
LINGER_MS = 500  # how long exit waits to flush queued messages to a live agent
URGENT = frozenset({"exc", "exiting"})  # message types that ring the agent's doorbell


def bell_address(addr: str) -> str:
    """The agent's doorbell endpoint, next to its channel's (an ``ipc://`` path)."""
    return addr + ".bell"


class Channel:
    """PUSH socket to the agent; ``emit`` never blocks and never raises."""

    def __init__(self, addr: str | None, rank: int, *, hwm: int = SEND_HWM, linger_ms: int = LINGER_MS):
        self.addr = addr
        self.rank = rank
        self.linger_ms = linger_ms
        self.sent = 0
        self.dropped = 0
        self._pid = os.getpid()
        # zmq sockets are not thread-safe; the snapshot writer and thread excepthook send too.
        self._lock = threading.Lock()
        self._ctx: Any = None
        self._sock: Any = None
        self._bell: Any = None
        if addr:
            import zmq  # only workers that have an agent pay for the import

            # A private context: closing ours never disturbs zmq use in the training script.
            self._ctx = zmq.Context(io_threads=1)
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.LINGER, linger_ms)
            bell = self._ctx.socket(zmq.PUSH)
            bell.setsockopt(zmq.SNDHWM, 1)  # one ring waiting is as good as many
            # A ring still queued at close is dropped: the process is exiting, and its exit
            # wakes the agent anyway. Lingering on it would hold the exit up where no agent listens.
            bell.setsockopt(zmq.LINGER, 0)
            # Both sockets exist before either connects: the I/O thread opens a connection's fd
            # when it gets to it, so the sockets' own fds always take the same numbers.
            sock.connect(addr)
            bell.connect(bell_address(addr))
            self._sock, self._bell = sock, bell

    @property
    def active(self) -> bool:
        return self._sock is not None and os.getpid() == self._pid

    def emit(self, t: str, **fields: Any) -> bool:
        """Send ``{"t": t, "rank": .., **fields, "ts": now}``; False if dropped or inactive."""
        if not self.active:
            return False
        msg = {"t": t, "rank": self.rank, **fields, "ts": time.time()}
        data = json.dumps(msg, separators=(",", ":"), default=str).encode()
        import zmq

        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.send(data, zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again (queue full) or a socket in a bad state
                self.dropped += 1
                return False
            self.sent += 1
            if t in URGENT:
                try:
                    self._bell.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:  # a ring already waiting, or no agent: the batch reads it
                    pass
            return True

    def close(self, linger_ms: int | None = None) -> None:
        """Flush (up to the linger) and close. Safe to call twice and in forked children."""
        with self._lock:
            sock, bell, ctx = self._sock, self._bell, self._ctx
            self._sock = self._bell = self._ctx = None
        if sock is None or os.getpid() != self._pid:
            return  # a forked child must not touch the parent's zmq state
        linger = self.linger_ms if linger_ms is None else linger_ms
        sock.close(linger=linger)
        bell.close(linger=0)
        ctx.term()


_channel: Channel | None = None
_channel_lock = threading.Lock()


def get() -> Channel:
    """This process's channel, created from the environment on first use."""
    global _channel
    ch = _channel
    if ch is not None and ch._pid == os.getpid():
        return ch
    with _channel_lock:
        if _channel is None:
            _channel = Channel(env.path_or_none(env.AGENT_ADDR), env.rank())
            if _channel.active:
                atexit.register(_channel.close)
        elif _channel._pid != os.getpid():
            # A forked child (dataloader worker, Hogwild process) is not the worker the agent
            # started: it stays silent rather than speak with its parent's rank.
            _channel = Channel(None, _channel.rank)
        return _channel


def reset_for_tests() -> None:
    """Close and forget the process channel (in-process tests only)."""
    global _channel
    with _channel_lock:
        if _channel is not None:
            _channel.close(linger_ms=0)
        _channel = None
