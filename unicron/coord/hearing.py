"""What the coordinator hears, and what it makes of hearing nobody (the shell around the pure
``unicron.coord.deafness``).

Nodes are judged by their silence, but when every node the coordinator could hear over the
network falls silent at once, its own link is the likelier fault, and no job counts that
silence against its nodes. Two things decide what "every node" is:

- **The node it is embedded in does not count.** Its agent talks to it over the host's own
  stack, so it is heard whatever the network does: a coordinator embedded in a node's launcher
  whose link is cut hears that one agent and nobody else, and would declare every healthy node
  lost (acceptance 18C F6). So its own node's words are not hearing, and the rule needs two
  nodes or more besides it: with one, that node's silence is as likely its own.
- **A silent node's host that answers is hearing.** Launchers killed together (a scheduler's
  preemption, an operator's Ctrl-C on two nodes) fall silent at once too, as a cut would make
  them, but their hosts still answer a TCP connect (with a handshake or a refusal: either one
  crossed the network). While nobody is heard, the coordinator connects to each silent node's
  address, at its own port (one its cluster's firewall lets through), once a second: an answer
  means the network works and the silence is the nodes' own, so they are lost at the timeout as
  before. Hosts that answer nothing (cut off, or powered off all at once) get the excuse, up to
  its cap.

While a job excuses silence, its acks say ``deaf``: the agent of the coordinator's own node then
calls no hang (its ranks wait on the silent nodes' ranks, as the cut-off nodes' agents, which
hear no coordinator, call none either) and takes that time off its ranks' hang clocks after.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

from unicron.coord.deafness import DeafWatch
from unicron.netprobe import Address, Prober, hosts_answer

PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.0


def hosts_probe(clock: Callable[[], float], *, every_s: float = PROBE_EVERY_S,
                answer: Callable[[Collection[Address], float], bool] = hosts_answer) -> Prober:
    """What asks silent nodes' hosts whether they answer (``answer``: tests give their own)."""
    return Prober(answer, clock=clock, every_s=every_s, timeout_s=PROBE_TIMEOUT_S)


class Slot(Protocol):  # what this module reads of the server's JobSlot
    core: Any
    events: Any
    finished_at: float | None


class Hearing:
    """The coordinator's hearing across its jobs: who was heard, from where, and the excuse
    for a silence that is likelier its own."""

    def __init__(self, clock: Callable[[], float], port: int, pinned: Collection[str],
                 probe: Prober | None = None) -> None:
        self.clock, self.port, self.pinned = clock, port, pinned  # pinned: shared, filled later
        self.deaf = DeafWatch(clock())
        self.probe = probe if probe is not None else hosts_probe(clock)
        self.addresses: dict[str, str] = {}  # node id -> the address its last message came from
        self._probe_seen: float | None = None

    def message(self, node_id: object, peer: str | None, now: float, slots: Mapping[str, Slot]) -> None:
        """A node's message came (from ``peer``, its address as the socket saw it)."""
        if not isinstance(node_id, str):
            return
        if peer:
            self.addresses[node_id] = peer
        if node_id not in self.pinned:
            self._heard(now, slots)

    def paused(self, gap_s: float) -> None:
        self.deaf.paused(gap_s)

    def deaf_for(self, job_id: str) -> bool:
        """Whether ``job_id`` excuses silence now (its acks say so)."""
        return self.deaf.spell_started(job_id)

    def turn(self, now: float, slots: Mapping[str, Slot]) -> None:
        """Once per loop turn: take a probe's answer, excuse what silence is the coordinator's
        own, and say what to probe."""
        answered = self.probe.answered_at
        if answered is not None and answered != self._probe_seen:
            self._probe_seen = answered
            self._heard(answered, slots)
        going = [(job_id, slot) for job_id, slot in slots.items() if slot.finished_at is None]
        # Counted, not listed, on every turn: a job of thousands of nodes turns often.
        nodes = sum(slot.core.members.count() - sum(1 for n in self.pinned if slot.core.members.is_active(n))
                    for _, slot in going)
        for job_id, slot in going:
            told = self.deaf.spell_started(job_id)
            spec = slot.core.spec
            gap_s = self.deaf.excuse(job_id, now, interval_s=spec.heartbeat_interval_s,
                                     timeout_s=spec.heartbeat_timeout_s, nodes=nodes)
            if gap_s > 0:
                slot.core.paused(gap_s)
                if not told:
                    own = sorted(n for n in self.pinned if slot.core.members.is_active(n))
                    slot.events.emit("coordinator_deaf", silent_s=round(self.deaf.deaf_s(now), 3),
                                     nodes=nodes, cap_s=self.deaf.cap_s, own_nodes=own)
        # Probe once the silence is longer than any job's heartbeats leave between two words.
        after = min((2 * slot.core.spec.heartbeat_interval_s for _, slot in going), default=None)
        wanted: set[Address] = set()
        if after is not None and nodes >= 2 and self.deaf.deaf_s(now) > after:
            wanted = {(self.addresses[n.node_id], self.port) for _, slot in going
                      for n in slot.core.members.active_any_order()
                      if n.node_id not in self.pinned and n.node_id in self.addresses}
        self.probe.want(wanted)

    def _heard(self, now: float, slots: Mapping[str, Slot]) -> None:
        # The nodes still silent when the first is heard again come back as their own TCP
        # connections retransmit, each on a timer that backs off to about as long as the
        # silence lasted (a 6 s cut can leave one node's heartbeats waiting 6 s more): each
        # job gives them that much again, so that a link that is back loses nobody.
        grace_s = min(self.deaf.deaf_s(now), self.deaf.cap_s)
        for job_id, excused_s in self.deaf.heard(now).items():
            slot = slots.get(job_id)
            if slot is not None and slot.finished_at is None:
                slot.core.paused(grace_s)
                slot.events.emit("coordinator_hears_again", excused_s=round(excused_s, 3),
                                 grace_s=round(grace_s, 3))

    def close(self) -> None:
        self.probe.close()
