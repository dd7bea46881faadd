"""The workers' channel, agent side: a PULL socket for every rank's messages and a doorbell.

Workers send JSON datagrams (``unicron.worker.channel``); the agent reads them in batches
(``pace``), so an urgent one (an exception, a rank's last words) also rings the doorbell, a
second socket that is always polled. A ring carries nothing: it only makes the agent read the
channel now. What is not a JSON object with a string ``t`` is counted and dropped, never raised.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import zmq

from unicron.proto.messages import strict_loads
from unicron.proto.schema import OPT_INT, field_errors
from unicron.worker.channel import bell_address

log = logging.getLogger(__name__)

MAX_BATCH = 1000  # messages read per drain: a flood cannot hold the loop
MAX_MESSAGE_BYTES = 1 << 20
MAX_RING_BYTES = 64


class MessageSink(Protocol):
    def on_message(self, msg: dict[str, Any], now: float) -> dict[str, Any] | None: ...


class WorkerInbox:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.bell = ctx.socket(zmq.PULL)
        self.bell.setsockopt(zmq.LINGER, 0)
        self.bell.setsockopt(zmq.MAXMSGSIZE, MAX_RING_BYTES)
        try:
            self.pull.bind(address)
            self.bell.bind(bell_address(address))
        except zmq.ZMQError:
            self.close()
            raise
        self.dropped = 0  # datagrams that were not a worker message, or came with no group

    def read(self, sink: MessageSink | None) -> tuple[int, list[dict[str, Any]]]:
        """Apply the waiting messages (at most ``MAX_BATCH``) to ``sink``; returns how many were
        read and the faults they raised, in order."""
        faults: list[dict[str, Any]] = []
        for count in range(MAX_BATCH):
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count, faults
            try:
                msg = strict_loads(raw)  # what reaches the coordinator must be JSON it can sign
            except (ValueError, RecursionError):  # RecursionError: nested deeper than json parses
                msg = None
            if not isinstance(msg, dict) or not isinstance(msg.get("t"), str) or sink is None or not well_formed(msg):
                self.dropped += 1
                continue
            try:
                fault = sink.on_message(msg, time.time())
            except Exception:  # noqa: BLE001 - a script may write here too: its garbage must not end the launcher
                log.debug("dropped a worker message that could not be applied: %.200r", msg, exc_info=True)
                self.dropped += 1
                continue
            if fault is not None:
                faults.append(fault)
        return MAX_BATCH, faults

    def drain_bell(self) -> int:
        """Empty the doorbell; returns how many rings there were."""
        for count in range(MAX_BATCH):
            try:
                self.bell.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
        return MAX_BATCH

    def close(self) -> None:
        self.pull.close(0)
        self.bell.close(0)


# The fields of the messages that can fail a job or move its clocks, with their types (as the
# mesh's schemas write them): one of another shape is a script's garbage on the channel, dropped
# (acceptance 27C F4: an ``exc`` with ``"fatal": "yes"`` and numbers for its text failed a job
# whose workers all exited 0). Other fields (rank, ts) ride along.
WORKER_FIELDS: dict[str, dict[str, Any]] = {
    "exc": {"type": str, "msg": str, "tb": str, "fatal?": bool, "pending?": bool, "ready?": bool},
    "step": {"step": int, "snap?": OPT_INT},
    "exiting": {"code": int, "pending?": bool, "ready?": bool},
    "closed": {"raising?": bool},
}


def well_formed(msg: dict[str, Any]) -> bool:
    """Whether a worker message has the fields its kind needs, of their types (a kind not
    listed needs none); steps and exit statuses (0-255) are never negative."""
    schema = WORKER_FIELDS.get(msg["t"], {})
    return field_errors(schema, msg) is None and not any(
        type(v) is int and v < 0 for v in (msg.get(name.rstrip("?")) for name in schema))
