"""How an agent goes back into its job (the shell around ``unicron.agent.joining``): fenced by
the coordinator (its workers stopped, their snapshots kept), or resuming the attempt its workers
run with a coordinator that restarted (``unicron.coord.resume``); and how it ends when the
coordinator is gone for good."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from unicron.agent.joining import JoinState, Rejoin, Resume, resume_fields
from unicron.agent.link import CoordinatorLink
from unicron.agent.ranks import all_past_init, store_untouched
from unicron.agent.shm import scan_snapshots
from unicron.agent.ui import fault_line
from unicron.agent.workers import WorkerGroup
from unicron.detect.classify import root_cause
from unicron.detect.faults import Fault
from unicron.errors import RendezvousError
from unicron.events import EventLog

UNREACHABLE = "its connection open but its host unreachable (a partition, or the host is down)"


class Rejoiner:
    def __init__(self, joining: JoinState, link: CoordinatorLink, *, endpoint: str, shm_dir: str, ui: Any,
                 events: EventLog) -> None:
        self.joining, self.link = joining, link
        self.endpoint, self.shm_dir = endpoint, shm_dir
        self.ui, self.events = ui, events

    def welcomed(self, epoch: int, attempt: int | None) -> None:
        """A ``welcome``: a member again, if this was a re-join (``attempt``: the last workers')."""
        ended = self.joining.on_welcome()
        if isinstance(ended, Resume):
            self.events.emit("resumed", epoch=epoch, attempt=attempt)
            self.ui.info("the coordinator took the job back")
        elif ended is not None:
            self.events.emit("rejoined", epoch=epoch, attempt=ended.attempt)
            self.ui.info("joined the job again; it re-forms with this node")

    def fenced(self, reason: str, attempt: int | None, *, cut_off: bool = False) -> None:
        """The coordinator no longer counts this node, and its workers (of ``attempt``) were
        stopped: their peers went on without them. Join again, telling what they left in memory.
        ``cut_off``: no coordinator answered (``unreachable``); it counts this node lost and
        waits for it up to the join timeout, and so long this node tries."""
        snapshots, sizes = scan_snapshots(self.shm_dir)
        self.joining.fenced(Rejoin(attempt, snapshots, sizes), time.monotonic(),
                            self.joining.full_timeout_s if cut_off else self.link.lost_after_s,
                            cut_off=reason if cut_off else None)
        self.events.emit("fenced", reason=reason, attempt=attempt, **({"cut_off": True} if cut_off else {}))

    def resume(self, reason: str, attempt: int | None, fields: Callable[[], dict[str, Any]], *,
               finished: bool = False) -> None:
        """The coordinator answers but does not know the job: it restarted, and lost it. The
        workers train on (or ``finished``); join again with ``fields()``: the attempt they run,
        and what they did meanwhile, so that the coordinator takes the job back."""
        going = "this node's workers all exited 0" if finished else "the workers train on"
        # A node that had joined but got no attempt yet has none to resume (30B F5: it said so all
        # the same, "the workers train on", with no workers).
        how = "joining it again" if attempt is None else f"joining it again with the running attempt, {going}"
        self.ui.warn(f"the coordinator at {self.endpoint} does not know this job ({reason}: it restarted?); {how}")
        self.joining.fenced(Resume(fields), time.monotonic(), self.link.lost_after_s)
        self.events.emit("resuming", reason=reason, attempt=attempt)

    def resume_fields(self, group: WorkerGroup | None, assign: dict[str, Any] | None, *, pending: bool,
                      epoch: int, faults: list[dict[str, Any]]) -> dict[str, Any]:
        """What a coordinator that lost the job needs to take it back: the attempt of the last
        ``assign`` (``pending``: its workers not started yet) and how far its workers got."""
        state = "stopped"  # a restart's stop came, its next assign did not
        started = False  # every rank past init_process_group (their store is not needed again)
        untouched = False  # no rank has called init_process_group (none used the store yet)
        if pending:
            state, untouched = "running", True  # its workers start as soon as the zygote is ready
        elif group is not None and assign is not None and group.spec.attempt == assign["attempt"]:
            state = "finished" if group.finished_reported else "running"
            started, untouched = all_past_init(group.ranks.values()), store_untouched(group.ranks.values())
        snapshots, sizes = scan_snapshots(self.shm_dir) if state == "stopped" else ({}, {})
        return resume_fields(assign, epoch=epoch, state=state, faults=faults, snapshots=snapshots,
                             snapshot_bytes=sizes, started=started or state != "running",
                             store_untouched=untouched and state == "running")

    def end_unconfirmed(self, why: str) -> int:
        """This node's workers all exited 0, and the coordinator now on the endpoint does not
        count it (a new one, after the job's end went unconfirmed): the node did its part, as
        when the coordinator goes silent (``lost``)."""
        return self._did_its_part(f"the job's end was not confirmed ({why})", reason=why)

    def _did_its_part(self, what: str, **fields: Any) -> int:
        self.ui.warn(f"{what}; this node's workers all exited 0")
        self.events.emit("coordinator_lost", finished=True, **fields)
        return 0

    def unreachable(self, finished: bool, faults: Sequence[dict[str, Any]] = ()) -> str | None:
        """Why the silent coordinator is taken for one cut off from this node, not gone: its
        connection is open but its host does not answer (a partition; or the host is down or
        frozen whole). None otherwise (``lost`` ends the node).

        A partition that outlasts the heartbeat timeout got this node declared lost on the
        other side, whose job waits for it to join again (up to the join timeout); so this node
        stops its workers, keeping their snapshots, and joins again as a fenced one does, for
        as long. Acceptance 27B F1: it exited after 15 s, its snapshots gone, and the job went
        back to its first step. A closed connection (the coordinator's process died) or a live
        host whose coordinator does not answer still ends the node (``lost``)."""
        now = time.monotonic()
        if finished or not self.link.open or self.link.lives_unheard(now):
            return None
        return (f"lost the coordinator at {self.endpoint}: no answer for {self.link.limit_s(now):g} s, "
                f"{UNREACHABLE}{reported(faults)}")

    def lost(self, finished: bool, faults: Sequence[dict[str, Any]] = ()) -> int:
        """The coordinator is gone. If this node's workers had all ``finished`` cleanly, the node
        did its part: exit 0, as torchrun's agent does when its exit barrier fails. Else the root
        cause among the ``faults`` this node reported in the attempt (no decision came for it)
        is the job's as far as this node knows: said after the loss (27B F6: lost)."""
        now = time.monotonic()
        if finished:
            return self._did_its_part(f"the coordinator at {self.endpoint} did not confirm the job's end (no "
                                      f"answer for {self.link.limit_s(now, done=True):g} s)")
        if not self.link.open:
            how = "its connection closed (its process died?)"
        elif self.link.lives_unheard(now):
            how = "its connection open and its host up (its process stopped?)"
        else:
            how = UNREACHABLE
        raise RendezvousError(f"lost the coordinator at {self.endpoint}: no answer for "
                              f"{self.link.limit_s(now):g} s, {how}{reported(faults)}")


def reported(faults: Sequence[dict[str, Any]]) -> str:
    """The root cause among the failures this node reported in the attempt, which no decision
    came for, as the end of the line that says the coordinator is lost (27B F6, 28B F2): the
    classifier's, so a peer's lost connection reported first does not hide the rank that died."""
    failed = [f for f in faults if f.get("kind") in ("exit", "exception", "hang", "startup")]
    if not failed:
        return ""
    parsed = []
    for raw in failed:
        try:
            parsed.append((Fault.from_report(raw), raw))
        except ValueError:  # not a shape the classifier takes: named as reported
            continue
    cause = root_cause([f for f, _ in parsed]) if parsed else None
    first = next((raw for f, raw in parsed if f is cause), failed[0])
    return f"; before it, this node reported {fault_line(first, '')}"
