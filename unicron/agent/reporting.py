"""What a node agent tells the coordinator: messages, faults (with the health evidence that may
explain them) and heartbeats that carry its ranks' activity."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

import zmq

from unicron.agent.healthwatch import HealthWatch, read_health_safely
from unicron.agent.ui import fault_line
from unicron.agent.workers import WorkerGroup
from unicron.detect.activity import Activity
from unicron.events import EventLog
from unicron.proto.messages import Codec

log = logging.getLogger(__name__)


class Reporter:
    """The agent's side of the DEALER: never blocks (a full queue drops, the next heartbeat
    says the same again)."""

    def __init__(self, codec: Codec, *, node_id: str, host: str, heartbeat_interval_s: float,
                 events: EventLog, ui: Any) -> None:
        self.codec = codec
        self.node_id = node_id
        self.host = host
        self.heartbeat_interval_s = heartbeat_interval_s
        self.events = events
        self.ui = ui
        self.dealer: zmq.Socket | None = None  # set once the agent's loop has connected it
        self.health = HealthWatch()
        self.last_heartbeat = 0.0  # monotonic time of the last heartbeat sent
        self.sent_level = Activity.IDLE
        self.sent_done = False  # whether the last heartbeat said some local rank is past its last step
        # The ranks of the last workers stopped, as they ended: heartbeats show them until new
        # workers start (``unicron status`` lists a failed rank after its job failed, and the
        # ranks of a node that waits for a lost peer).
        self.ended_workers: list[dict[str, Any]] = []
        # Every fault reported since the last assign (health evidence too): what a restarted
        # coordinator, which lost them, is told in this node's resume (unicron.coord.resume).
        self.attempt_faults: list[dict[str, Any]] = []
        self.restarts_seen = 0  # the restart count of the last attempt that ran here (the live line)

    def send(self, kind: str, body: dict[str, Any]) -> None:
        if self.dealer is None:
            return
        try:
            self.dealer.send(self.codec.encode(kind, body), zmq.NOBLOCK)
        except zmq.Again:
            log.debug("coordinator queue full; %s dropped", kind)

    def report(self, fault: dict[str, Any], group: WorkerGroup | None) -> None:
        attempt = group.spec.attempt if group is not None else -1
        if fault.get("kind") == "exit" and fault.get("exitcode") == -signal.SIGKILL:
            reading = self.health.with_oom_kills_now()  # was it the OOM killer? (the classifier asks)
            if reading is not None:
                self._check_health(reading, group)
        self.attempt_faults.append(fault)
        fields = {k: v for k, v in fault.items() if k not in ("stderr_tail", "traceback", "kind", "ts")}
        self.events.emit("fault", fault_kind=fault.get("kind"), occurred_at=fault.get("ts"), **fields)
        self.ui.warn(fault_line(fault, self.node_id))
        self.send("fault", {"node_id": self.node_id, "attempt": attempt, "fault": fault})
        if fault.get("kind") in ("exit", "exception") and self.health.evidence:
            # Recent health changes travel with the failure they may explain, after it: the
            # coordinator stops the attempt on the first fault it hears and names it as the
            # reason, and a host's note (another process OOM-killed) is not why it stopped.
            # The decision waits for every node's stop, so the classifier still sees them.
            for item in self.health.take_evidence():
                evidence = dict(item, attempt=attempt)
                self.attempt_faults.append(evidence)
                self.send("fault", {"node_id": self.node_id, "attempt": attempt, "fault": evidence})

    def heartbeat(self, group: WorkerGroup | None, *, epoch: int, now: float | None = None,
                  at_once: bool = False, starting: bool = False) -> None:
        """Send a heartbeat if one is due, the ranks' activity changed, or ``at_once``.
        ``starting``: an attempt is assigned and its workers wait for the zygote's imports: BUSY,
        since the other nodes' ranks wait for this node's (an idle verdict would blame them)."""
        now = time.monotonic() if now is None else now
        # A group that finished or reported a hang samples no more: its last level is stale.
        running = group is not None and not group.finished_reported and not group.hang_reported
        level = group.level if running and group is not None else Activity.IDLE
        if starting:
            level = max(level, Activity.BUSY)
        done = group is not None and group.past_last_step()
        # A change of activity goes out at once: other agents' hang thresholds depend on it; and
        # a rank past its last step, which ends their hang calls.
        if (not at_once and now - self.last_heartbeat < self.heartbeat_interval_s and level == self.sent_level
                and done == self.sent_done):
            return
        self.last_heartbeat, self.sent_level, self.sent_done = now, level, done
        if self.health.due(now):
            self._check_health(read_health_safely(), group)
        workers = group.summary() if group is not None else self.ended_workers
        self.send("heartbeat", {"node_id": self.node_id, "epoch": epoch,
                                "attempt": group.spec.attempt if group else -1,
                                "workers": workers, "health": self.health.reading,
                                "activity": level.name.lower(), "done": done})
        self.ui.update(workers, attempt=group.spec.attempt if group else None,
                       world_size=group.spec.world_size if group else None,
                       restarts=group.spec.restart_count if group else self.restarts_seen)
        if group is not None:
            self.restarts_seen = group.spec.restart_count

    def _check_health(self, reading: dict[str, Any], group: WorkerGroup | None) -> None:
        report, kept = self.health.update(reading, node=self.node_id, host=self.host, running=group is not None,
                                          attempt=group.spec.attempt if group is not None else -1)
        for fault in report:
            self.report(fault, group)
        for f in kept:
            self.events.emit("health", error_type=f.error_type, message=f.message, gpu=f.gpu)
