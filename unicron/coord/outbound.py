"""The coordinator server's outbound half (a part of ``unicron.coord.server.CoordinatorServer``):
it carries out what a job's core asks (``unicron.coord.outbox``): sends, to the socket a node was
heard from (orders to its earlier ones too), event records, a store opened off the loop and the
attempt started once it is ready, a job's end told to every node.

Split from ``unicron.coord.server``, which reads and routes what comes in: what goes out, and
to which socket, is one concern, with its own rules (a node's earlier sockets, deafness).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from unicron.coord.hearing import Hearing
from unicron.coord.membership import NodeState
from unicron.coord.outbox import Emit, Finish, OpenStore, Out, Send
from unicron.coord.resume import store_opened_again
from unicron.coord.slots import ORDERS, JobSlot
from unicron.coord.stores import StoreOpener
from unicron.errors import ProtocolError
from unicron.proto.messages import Codec

log = logging.getLogger(__name__)


class Outbound:
    """The outbound half of a ``CoordinatorServer``, whose attributes these are."""

    sock: zmq.Socket
    codec: Codec
    hearing: Hearing
    stores: StoreOpener
    slots: dict[str, JobSlot]
    advertise_addr: str
    clock: Callable[[], float]

    def _run(self, job_id: str, slot: JobSlot, outs: list[Out]) -> None:
        queue = list(outs)
        while queue:
            out = queue.pop(0)
            if isinstance(out, Send):
                if out.kind == "ack" and self.hearing.says_deaf(job_id, slot):
                    out = Send(out.node_id, out.kind, dict(out.body, deaf=True))
                # Only to the socket a node was heard from: its name has a part nobody can guess
                # (unicron.agent.agent). A node of an attempt taken back after a restart that
                # has not spoken yet hears what it needs when it resumes (unicron.coord.resume).
                identity = slot.identities.get(out.node_id)
                if identity is not None:
                    self._send_raw(identity, job_id, out.kind, out.body)
                for earlier in slot.earlier.get(out.node_id, ()) if out.kind in ORDERS else ():
                    self._send_raw(earlier, job_id, out.kind, out.body)
            elif isinstance(out, Emit):
                slot.events.emit(out.kind, **out.fields)
            elif isinstance(out, OpenStore) and out.port and out.addr not in ("", self.advertise_addr):
                queue += store_opened_again(slot.core, out.attempt, out.port, f"its ranks look for it at {out.addr}, "
                                            f"this coordinator is at {self.advertise_addr}", self.clock())
            elif isinstance(out, OpenStore):
                self.stores.open(job_id, out.attempt, out.port)  # off the loop: heartbeats are answered meanwhile
            elif isinstance(out, Finish):
                # Lost nodes too: one that only stalled finds the word in its socket when it runs
                # again, rather than waiting out the coordinator's silence.
                for node in slot.core.members.nodes.values():
                    identity = slot.identities.get(node.node_id)
                    if node.state is NodeState.LEFT or identity is None:
                        continue
                    for to in (identity, *slot.earlier.get(node.node_id, ())):
                        self._send_raw(to, job_id, "shutdown", {"exit_code": out.exit_code, "reason": out.reason})
                slot.finished_at = self.clock()
                slot.stores.close_all()

    def _send_raw(self, identity: bytes, job: str, kind: str, body: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([identity, self.codec.encode(kind, body, job=job)], zmq.NOBLOCK)
        except zmq.ZMQError as err:  # peer gone or queue full: it will time out on its side
            log.debug("send %s failed: %s", kind, err)
        except ProtocolError as err:  # over the size limit: the coordinator goes on for the others
            log.error("not sent: %s", err)

    def _start_ready_attempts(self) -> None:
        for job_id, attempt, store, error in self.stores.ready():
            slot = self.slots.get(job_id)
            if slot is None or slot.finished_at is not None:
                if store is not None:
                    store.close()
                continue
            now = self.clock()
            reopened = slot.core.store_reopened
            if reopened is not None and reopened[0] == attempt:  # an attempt taken back: never a fresh one's
                if store is not None:
                    slot.stores.keep(attempt, store)
                self._run(job_id, slot, store_opened_again(slot.core, attempt, reopened[1], error, now))
                continue
            if store is None:
                self._run(job_id, slot, slot.core.fail(error, now))
                continue
            try:
                slot.stores.keep(attempt, store)
                self._run(job_id, slot, slot.core.start_attempt(self.advertise_addr, store.port, now))
            except Exception as err:  # as in _tick: this job ends with its cause; the thread serves on
                log.exception("error starting attempt %s of job %s", attempt, job_id)
                self._run(job_id, slot, slot.core.fail(f"coordinator error: {type(err).__name__}: {err}", now))

