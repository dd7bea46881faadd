"""The coordinator's shell: a ZeroMQ ROUTER serving one or many jobs.

It decodes and verifies every message (dropping and counting bad ones; nothing a peer sends
can crash or block it), routes it to that job's ``JobCore``, and carries out what the core
asks: sends, a fresh TCPStore per attempt (``unicron.coord.stores``), event records, the end of
a job (``unicron.coord.outbound``). What it tells the user about peers it cannot serve is in
``unicron.coord.peers``.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from unicron.coord.decide import Decider
from unicron.coord.hearing import Hearing, peer_address
from unicron.coord.job import JobCore
from unicron.coord.outbound import Outbound
from unicron.coord.peers import PeerWarnings, other_job
from unicron.coord.records import JobSpec
from unicron.coord.resume import resume_window
from unicron.coord.slots import JobSlot, rebind
from unicron.coord.statusfit import fit_status, size
from unicron.coord.stores import StoreOpener, preload
from unicron.detect.stall import StallWatch
from unicron.errors import ProtocolError
from unicron.events import EventLog
from unicron.netprobe import Prober
from unicron.proto.messages import MAX_MESSAGE_BYTES, Codec, Message, StaleMessage, WrongJob

log = logging.getLogger(__name__)

TICK_S = 0.05  # the pace while a job forms or restarts
IDLE_WAKE_S = 0.5  # the longest sleep between messages
ENVELOPE_BYTES = 512  # a message's bytes besides its body, its job id and its sender


class CoordinatorServer(Outbound):
    """Serve jobs on ``tcp://bind_host:port``.

    ``jobs`` restricts which job ids are served (the embedded coordinator serves exactly its
    own); None serves any job that joins (the standalone ``unicron coordinator``).
    ``events_for(job_id)`` gives the EventLog of a job.
    """

    def __init__(
        self,
        key: bytes,
        *,
        bind_host: str,
        port: int,
        events_for: Callable[[str], EventLog],
        decider_for: Callable[[], Decider],
        jobs: set[str] | None = None,
        exit_when_done: bool = False,
        advertise_addr: str = "",
        clock: Callable[[], float] = time.time,
        warn: Callable[[str], None] | None = None,
        probe: Prober | None = None,
    ) -> None:
        self.codec = Codec(key, f"coordinator-{os.getpid()}-{os.urandom(4).hex()}", job="",
                           accept_jobs=set(jobs) if jobs else set(), clock=clock)
        self.jobs_allowed = jobs
        self.events_for = events_for
        self.decider_for = decider_for
        self.exit_when_done = exit_when_done
        # MASTER_ADDR for workers; "" lets each agent use the address it reached us at.
        self.advertise_addr = advertise_addr
        self.ended_on_stop: list[str] = []  # jobs still going that ``stop`` ended (read it once it returned)
        self.clock = clock
        self.started_at = clock()  # a standalone one's jobs may outlive it (resume_window)
        # Told to the user (not just counted): messages that say a node is misconfigured.
        self.peers = PeerWarnings(warn, self.codec.window_s)
        # Nodes a reconfigure never leaves out: the agent this coordinator is embedded in (its
        # exit would end the coordinator, and with it every job). Shared with each job's core.
        self.pinned: set[str] = set()
        self.job_settings: dict[str, dict[str, Any]] = {}  # job -> a join body whose settings define it
        self.slots: dict[str, JobSlot] = {}
        self.ctx: zmq.Context = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * 1024 * 1024)
        # Dual stack: "*" then listens on IPv6 and IPv4 (libzmq falls back to IPv4 alone on a
        # host without IPv6), so agents can reach it at [::1]:PORT as under torchrun.
        self.sock.setsockopt(zmq.IPV6, 1)
        host = "*" if bind_host in ("", "0.0.0.0", "*") else bind_host
        try:
            if port == 0:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self.sock.close(0)
            raise
        self._stop = threading.Event()
        self._stop_reason = "the coordinator stopped"
        self._stop_code = 1  # the exit code recorded for jobs that ``stop`` ends
        self._end_jobs = True  # ``stop`` ends the jobs still going (else leaves them to a successor)
        self._keep_stores = False  # see ``stop``
        self._wake_addr = f"inproc://unicron-coordinator-wake-{id(self)}-{os.urandom(4).hex()}"
        self.stores = StoreOpener()
        self.thread: threading.Thread | None = None
        # Who is heard, from where; silence that is likelier this coordinator's own (``probe``:
        # how silent nodes' hosts are asked whether they answer; tests give their own).
        self.hearing = Hearing(clock, self.port, self.pinned, probe)

    # ---- lifecycle -----------------------------------------------------------------
    def unfinished_jobs(self) -> list[str]:
        """Jobs not ended (read it once ``stop`` has returned: the serving thread owns them)."""
        return sorted(job_id for job_id, slot in self.slots.items() if slot.finished_at is None)

    def start(self, *, preload_store: bool = True) -> None:
        """Serve on a thread. ``preload_store`` False: a store host will be given
        (``stores.host``), so nothing imports torch here."""
        if preload_store:
            preload()
        self.thread = threading.Thread(target=self.serve, name="unicron-coordinator", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 5.0, reason: str = "the coordinator stopped", exit_code: int = 1,
             *, end_jobs: bool = True, keep_stores: bool = False) -> None:
        """Stop serving; jobs still going end now (their nodes are told ``reason``; the job's
        end is recorded with ``exit_code``), or, without ``end_jobs``, are left to train on as
        after a crash: a coordinator started again on the port takes them back. ``keep_stores``:
        until a later ``stop``, for the workers still stopping (31A F2: closed under a rank waiting
        in one, in ``init_process_group``, it printed 40 lines of C++ stack)."""
        self._stop_reason, self._stop_code, self._end_jobs = reason, exit_code, end_jobs
        self._keep_stores = keep_stores
        self._stop.set()
        # Wake the serving thread now rather than at its next deadline (a socket of our own:
        # zmq sockets are not shared between threads).
        poke = self.ctx.socket(zmq.PUSH)
        poke.setsockopt(zmq.LINGER, 0)
        poke.connect(self._wake_addr)
        try:
            poke.send(b"", zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # not serving (yet, or any more): nothing to wake
        poke.close(0)
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)
        if not keep_stores and (self.thread is None or not self.thread.is_alive()):
            self._close_stores()  # kept by an earlier stop, or never served

    def serve(self) -> None:
        wake = self.ctx.socket(zmq.PULL)
        wake.bind(self._wake_addr)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        stalls = StallWatch(self.clock())
        try:
            while not self._stop.is_set():
                wait_s = self._wait_s()
                self._paused(stalls.lapse(self.clock()))
                events = dict(poller.poll(math.ceil(wait_s * 1000)))
                self._paused(stalls.lapse(self.clock(), wait_s))
                if wake in events:
                    wake.recv(zmq.NOBLOCK)
                if self.sock in events:
                    # Drain what is queued, bounded so ticks (loss detection) keep their pace.
                    for _ in range(256):
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_frames([f.bytes for f in frames], peer_address(frames[-1]))
                self._start_ready_attempts()
                now = self.clock()
                # A stall can land while the messages are handled, just before the verdicts.
                self._paused(stalls.lapse(now))
                self.hearing.turn(now, self.slots)
                for job_id, slot in list(self.slots.items()):
                    self._tick(job_id, slot, now)
                if self.exit_when_done and self.slots and all(
                        s.finished_at is not None for s in self.slots.values()):
                    break
            # Stopped with jobs still going (the launcher hosting it interrupted, a standalone
            # coordinator stopped): their nodes hear it now, not after their silence timeout.
            for job_id, slot in list(self.slots.items()):
                if slot.finished_at is None and self._end_jobs:
                    self.ended_on_stop.append(job_id)
                    self._run(job_id, slot, slot.core.fail(self._stop_reason, self.clock(), self._stop_code))
        finally:
            if not self._keep_stores:
                self._close_stores()
            self.hearing.close()
            wake.close(0)
            self.sock.close(linger=2000)

    def _close_stores(self) -> None:
        """Close every job's stores and end the store host (each close is idempotent)."""
        for slot in self.slots.values():
            slot.stores.close_all()
        self.stores.close()

    def _tick(self, job_id: str, slot: JobSlot, now: float) -> None:
        try:
            self._run(job_id, slot, slot.core.tick(now))
        except Exception as err:  # a bug ends this job with its cause, not every job with the thread
            log.exception("error in the tick of job %s", job_id)
            if slot.finished_at is None:
                self._run(job_id, slot, slot.core.fail(f"coordinator error: {type(err).__name__}: {err}", now))

    def _paused(self, gap_s: float) -> None:
        """This process was not running for ``gap_s`` (SIGSTOP, a VM or swap stall, a clock
        step): it heard nobody meanwhile, which says nothing about the nodes."""
        if gap_s > 0:
            self.hearing.paused(gap_s)
            for slot in self.slots.values():
                slot.core.paused(gap_s)

    def _wait_s(self) -> float:
        """How long to sleep when no message comes: until some job's next deadline (each
        wake-up takes CPU from the ranks on this host), at the fast pace while a store opens."""
        if self.stores.pending():
            return 0.0
        now = self.clock()
        due = min((slot.core.next_tick_s(now) for slot in self.slots.values()), default=IDLE_WAKE_S)
        return min(max(due, TICK_S), IDLE_WAKE_S)

    def metrics(self) -> dict[str, Any]:
        """Every job's metrics (``format_metrics`` input); called from the HTTP thread."""
        from unicron.coord.metrics import job_metrics

        jobs = []
        for slot in list(self.slots.values()):
            try:
                jobs.append(job_metrics(slot.core, self.codec.dropped.counts))
            except (RuntimeError, ValueError):  # state changed under us: skip this scrape's job
                continue
        return {"jobs": jobs}

    # ---- inbound -------------------------------------------------------------------
    def _on_frames(self, frames: list[bytes], peer: str | None = None) -> None:
        if len(frames) != 2:
            self.codec.dropped.add("malformed")
            return
        identity, raw = frames
        try:
            msg = self.codec.decode(raw)
        except StaleMessage as err:
            self._clock_off(identity, err)
            return
        except ProtocolError as err:
            log.debug("dropped message: %s", err)
            self.peers.misconfigured(identity, str(err), self.jobs_allowed)
            if isinstance(err, WrongJob) and err.kind == "join" and self.jobs_allowed:
                # Signed with our secret: a job of ours on the same endpoint, told so at once.
                self._send_raw(identity, err.job, "reject", {"reason": other_job(self.jobs_allowed, err.job)})
            return
        except Exception:  # noqa: BLE001 - one peer's bytes must never take the coordinator down
            log.debug("dropped a message that could not be read", exc_info=True)  # no console flood
            self.codec.dropped.add("malformed")
            return
        try:
            self._on_message(identity, msg)
        except Exception:  # a bug must not take the coordinator down with the job
            log.exception("error handling %s from %s", msg.kind, msg.sender)
            self.codec.dropped.add("handler-error")
        if msg.kind != "status_req":  # a node's message (``unicron status`` may come from this host)
            # After it is handled: a node that just joined is a member, whose address is kept.
            self.hearing.message(msg.body.get("node_id"), peer, self.clock(), self.slots, msg.job)

    def _clock_off(self, identity: bytes, err: StaleMessage) -> None:
        """An authentic message whose time is too far off: the sender is told this clock (and
        then signs with it), the user hears of it once (``unicron.coord.peers``)."""
        now = self.clock()
        why = self.peers.clock_off(identity, err.skew_s, now)
        if why is not None:
            self._send_raw(identity, err.job, "reject", {"reason": why, "wait": True, "clock": now})

    def _on_message(self, identity: bytes, msg: Message) -> None:
        now = self.clock()
        slot = self.slots.get(msg.job)
        if msg.kind == "status_req":
            if slot is None:
                self._send_raw(identity, msg.job, "reject", {"reason": f"no job {msg.job!r} here"})
            else:
                snap = slot.core.snapshot(now)
                snap["job"]["dropped_messages"] = self.codec.dropped.total
                if self.hearing.says_deaf(msg.job, slot):  # its silent nodes are not judged meanwhile
                    snap["job"]["silence_excused"] = True
                # Where nodes reach it: the address its workers are told (--local-addr, else the FQDN)
                host = self.advertise_addr or os.uname().nodename
                snap["job"]["coordinator"] = f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
                # A big job's view passes the message limit: what does not fit is left out, saying so.
                room = MAX_MESSAGE_BYTES - ENVELOPE_BYTES - size(msg.job) - size(self.codec.sender)
                self._send_raw(identity, msg.job, "status", {"snapshot": fit_status(snap, room)})
            return
        node_id = msg.body.get("node_id")
        if not isinstance(node_id, str):
            self.codec.dropped.add("schema")
            return
        if slot is None or (msg.kind == "join" and self._reopens(slot, msg.body)):
            if msg.kind != "join":
                # A member of a job this coordinator lost (it restarted): it joins again with
                # what it runs, and the job goes on (unicron.coord.resume).
                self._send_raw(identity, msg.job, "reject", {"reason": f"no job {msg.job!r} here",
                                                             "unknown_job": True})
                return
            held = slot is None and self.jobs_allowed is None and resume_window(now - self.started_at, msg.job, msg.body)
            if held:
                self._send_raw(identity, msg.job, "reject", {"reason": held, "wait": True})
                return
            slot = self._create_job(msg, now)
        rebind(slot, node_id, identity)
        handler = {"join": slot.core.on_join, "heartbeat": slot.core.on_heartbeat, "fault": slot.core.on_fault,
                   "stopped": slot.core.on_stopped, "finished": slot.core.on_finished,
                   "leave": slot.core.on_leave}.get(msg.kind)
        if msg.kind in ("heartbeat", "fault", "stopped", "finished") and slot.core.awaits_resume(node_id):
            handler = slot.core.on_unresumed
        if handler is None:
            self.codec.dropped.add("unexpected-kind")
            return
        self._run(msg.job, slot, handler(node_id, msg.body, now))

    def _reopens(self, slot: JobSlot, body: dict[str, Any]) -> bool:
        """A fresh launcher joins a job that failed or was interrupted (not one that finished):
        a new job of that id starts (a requeued Slurm job keeps its SLURM_JOB_ID, the id; the
        refusal used to last for this coordinator's life, acceptance 21B F2). torchrun's
        rendezvous, too, stays open after a failure and closes after a success. Only a
        standalone coordinator's: an embedded one ends with its job."""
        return (self.jobs_allowed is None and slot.finished_at is not None and slot.core.exit_code != 0
                and "resume" not in body and "attempt" not in body)

    def _create_job(self, msg: Message, now: float) -> JobSlot:
        # An embedded coordinator's job is defined by its own node's flags, known before anyone
        # joins; otherwise by the first node to join. A node whose flags differ is refused,
        # naming its own values, whichever joins first.
        b = self.job_settings.get(msg.job) or msg.body
        spec = JobSpec(job_id=msg.job, min_nodes=b["min_nodes"], max_nodes=b["max_nodes"],
                       max_restarts=b["max_restarts"], last_call_s=float(b["last_call_s"]),
                       heartbeat_timeout_s=float(b["heartbeat_timeout_s"]),
                       heartbeat_interval_s=float(b.get("heartbeat_interval_s", 0.5)),
                       join_timeout_s=float(b["join_timeout_s"]), stop_timeout_s=float(b["stop_timeout_s"]),
                       hang=dict(b.get("hang") or {}))
        core = JobCore(spec, self.decider_for(), now)
        core.pinned = self.pinned
        events = self.events_for(msg.job)
        events.listeners.append(core.recent_events.append)
        slot = JobSlot(core, events)
        self.slots[msg.job] = slot
        events.emit("job_created", min_nodes=spec.min_nodes, max_nodes=spec.max_nodes,
                    max_restarts=spec.max_restarts, port=self.port)
        return slot
