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

import ipaddress
import random
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import zmq

from unicron.coord.deafness import DeafWatch
from unicron.netprobe import Address, Prober, hosts_answer

PROBE_EVERY_S = 1.0
PROBE_TIMEOUT_S = 1.0
PROBE_AT_ONCE = 8  # silent nodes' hosts asked per probe, chosen at random


def hosts_probe(clock: Callable[[], float], *, every_s: float = PROBE_EVERY_S,
                answer: Callable[[Collection[Address], float], bool] = hosts_answer) -> Prober:
    """What asks silent nodes' hosts whether they answer (``answer``: tests give their own)."""
    return Prober(answer, clock=clock, every_s=every_s, timeout_s=PROBE_TIMEOUT_S)


def peer_address(frame: zmq.Frame) -> str | None:
    """The address a message came from, as its TCP connection says (None: not known)."""
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return None
    if not isinstance(address, str) or not address:
        return None
    try:  # a dual-stack socket names IPv4 peers as IPv6 ones (::ffff:10.0.0.2)
        mapped = ipaddress.ip_address(address)
    except ValueError:
        return address
    return str(mapped.ipv4_mapped) if isinstance(mapped, ipaddress.IPv6Address) and mapped.ipv4_mapped else address


class Slot(Protocol):  # what this module reads of the server's JobSlot
    core: Any
    events: Any
    finished_at: float | None


class Hearing:
    """The coordinator's hearing across its jobs: who was heard, when and from where, and the
    excuse for a silence that is likelier its own."""

    def __init__(self, clock: Callable[[], float], port: int, pinned: Collection[str],
                 probe: Prober | None = None) -> None:
        self.clock, self.port, self.pinned = clock, port, pinned  # pinned: shared, filled later
        self.deaf = DeafWatch(clock())
        self.probe = probe if probe is not None else hosts_probe(clock)
        # Of nodes that are members of a job (pruned past a bound): where and when their last
        # message came from, as this coordinator's socket and clock saw it.
        self.addresses: dict[str, str] = {}
        self.last_word: dict[str, float] = {}

    def message(self, node_id: object, peer: str | None, now: float, slots: Mapping[str, Slot], job: str) -> None:
        """A message came from ``node_id`` for ``job`` (from ``peer``, its address)."""
        if not isinstance(node_id, str):
            return
        slot = slots.get(job)
        if slot is not None and slot.core.members.is_active(node_id):
            if peer:
                self.addresses[node_id] = peer
            self.last_word[node_id] = now
            slot.core.loss_deferred.pop(node_id, None)  # heard: judged by its heartbeats again
        if node_id not in self.pinned:
            self._heard(now, slots, "node")

    def paused(self, gap_s: float) -> None:
        self.deaf.paused(gap_s)

    def says_deaf(self, job_id: str, slot: Slot) -> bool:
        """Whether ``job_id``'s acks say ``deaf``: while it excuses silence, or the loss of its
        silent nodes waits (their nodes' ranks wait on them: no hang is called on them)."""
        return self.deaf.deaf_for(job_id) or bool(slot.core.loss_deferred)

    def turn(self, now: float, slots: Mapping[str, Slot]) -> None:
        """Once per loop turn: take the probe's news, excuse what silence is the coordinator's
        own, and say what to probe."""
        answered, unanswered = self.probe.answered_at, self.probe.unanswered_at
        if answered is not None and answered > self.deaf.heard_at:  # started after the last word
            self._heard(answered, slots, "probe")
        if unanswered is not None:
            self.deaf.unanswered(unanswered)
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
            if slot.core.loss_deferred and self.deaf.deaf_for(job_id):
                self._hold_deferred(slot, now)
        # Probe once the silence is longer than every job's heartbeats leave between two words.
        after = max((2 * slot.core.spec.heartbeat_interval_s for _, slot in going if slot.core.members.count()),
                    default=None)
        wanted: list[Address] = []
        if after is not None and nodes >= 2 and self.deaf.deaf_s(now) > after:
            wanted = sorted({(self.addresses[n.node_id], self.port) for _, slot in going
                             for n in slot.core.members.active_any_order()
                             if n.node_id not in self.pinned and n.node_id in self.addresses})
            self._prune(going)
        # A few at once: one answer is enough, and each connect takes a descriptor of the
        # launcher's, whose limit is sized for its own ranks.
        self.probe.want(random.sample(wanted, PROBE_AT_ONCE) if len(wanted) > PROBE_AT_ONCE else wanted)

    def _heard(self, now: float, slots: Mapping[str, Slot], by: str) -> None:
        """A word, or a host's answer, after a silence. If the link was cut in it (a probe got
        no answer), the nodes still silent get their deferral even where the silence was too
        short for a spell: a cut of 2 s ends before the allowance, but leaves their connections
        backed off (acceptance 22A F1)."""
        silence_s, cut = self.deaf.deaf_s(now), self.deaf.cut_seen()
        excused = self.deaf.heard(now)
        if not excused and not cut:
            return
        for job_id, slot in slots.items():
            if slot.finished_at is not None:
                continue
            grace_s = self._defer_silent(slot, now, silence_s)
            if job_id in excused or grace_s:
                slot.events.emit("coordinator_hears_again", excused_s=round(excused.get(job_id, 0.0), 3),
                                 grace_s=round(grace_s, 3), by=by)

    def _defer_silent(self, slot: Slot, now: float, silence_s: float) -> float:
        """The nodes still silent when the first is heard again (or a host answers) come back
        as their own TCP connections retransmit, each on a timer that has backed off about as
        long as that node has been silent (a 6 s cut left one node's heartbeats 6 s behind the
        other's; a link that flapped for 30 s, 24 s: acceptance 22A F2): their loss waits that
        much longer, unless heard, and never past the cap from their last word. Returns the
        longest wait given (0: none was)."""
        spec = slot.core.spec
        longest = 0.0
        for node in slot.core.members.active_any_order():
            last = self.last_word.get(node.node_id)
            if node.node_id in self.pinned or last is None or now - last <= 2 * spec.heartbeat_interval_s:
                continue
            grace_s = min(max(silence_s, now - last), self.deaf.cap_s)
            until = min(now + grace_s, last + self.deaf.cap_s + spec.heartbeat_timeout_s)
            if until > now:
                slot.core.loss_deferred[node.node_id] = max(until, slot.core.loss_deferred.get(node.node_id, until))
                longest = max(longest, until - now)
        return longest

    def _hold_deferred(self, slot: Slot, now: float) -> None:
        """A new spell began while some nodes' loss waited: their silence is the coordinator's
        again, so their loss waits at least a heartbeat timeout past now, up to the cap from
        their last word (a link that flapped 2 s down, 1 s up lost a healthy node in the middle
        of a spell, and the others with it: acceptance 22A F1)."""
        spec = slot.core.spec
        for node_id, until in list(slot.core.loss_deferred.items()):
            last = self.last_word.get(node_id)
            if last is not None:
                held = max(until, now + spec.heartbeat_timeout_s)
                slot.core.loss_deferred[node_id] = min(held, last + self.deaf.cap_s + spec.heartbeat_timeout_s)

    def _prune(self, going: list[tuple[str, Slot]]) -> None:
        """Forget nodes no job has as a member, once there are many more than members."""
        if len(self.last_word) <= 2 * sum(slot.core.members.count() for _, slot in going) + 64:
            return
        members = {n.node_id for _, slot in going for n in slot.core.members.active_any_order()}
        for table in (self.addresses, self.last_word):
            for node_id in [n for n in table if n not in members]:
                del table[node_id]

    def close(self) -> None:
        self.probe.close()
