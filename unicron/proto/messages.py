"""Envelope encoding, HMAC signing and replay protection.

Wire format: one UTF-8 JSON object
``{"v": 3, "kind": str, "job": str, "sender": str, "seq": int, "ts": float, "body": {...}, "mac": hex}``
where ``mac`` is HMAC-SHA256 under the job secret over the canonical JSON (sorted keys, no
spaces) of every other field. JSON only: nothing on the wire is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from unicron.errors import ProtocolError
from unicron.proto.schema import schema_errors

# 2: join carries heartbeat_interval_s and a fenced node's attempt and snapshots; reject says
# fenced. 3: assign names the attempt's nodes and the restarts spent; join may resume an attempt
# with a restarted coordinator, which says unknown_job. 4: a heartbeat says whether some rank of
# the node is past its last step (done), an ack which attempt is (done). Peers of another version
# do not talk: their messages are dropped and counted. 5: assign carries the job's start and
# restarts (given back in a resume); reject may carry the coordinator's clock (``clock``).
# 6: an ack says when the coordinator hears no node over the network (``deaf``). 7: a fenced
# node's reject says whether this coordinator declared it lost (``lost``: its job wants it back).
# 8: a resume says whether no rank of the node used the attempt's store yet, and its port.
# 9: an ack tells a decision to restart as it is taken (``decided``), not with the next assign.
PROTOCOL_VERSION = 9
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_ENVELOPE_KEYS = {"v", "kind", "job", "sender", "seq", "ts", "body", "mac"}


@dataclass(frozen=True)
class Message:
    kind: str
    job: str
    sender: str
    seq: int
    ts: float
    body: dict[str, Any]


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def sign(key: bytes, payload: dict[str, Any]) -> str:
    return hmac.new(key, _canonical(payload), hashlib.sha256).hexdigest()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: json.loads takes them, nothing may send them


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"{text} is out of range")
    return value


INT_LIMIT = 1 << 63  # no integer on the mesh reaches it (a step, a count, a time in ns)


def _bounded(text: str) -> int:
    value = int(text)
    if abs(value) >= INT_LIMIT:  # nothing of ours counts that far; float() of it may overflow (acceptance 21C F1)
        raise ValueError(f"{text[:20]}... is out of range")
    return value


def strict_loads(raw: bytes | str) -> Any:
    """``json.loads`` refusing (ValueError) what no JSON writer of ours sends and the signing
    encoder cannot write back: NaN, Infinity, numbers that overflow to infinity, integers
    beyond 64 bits."""
    return json.loads(raw, parse_constant=_no_constant, parse_float=_finite, parse_int=_bounded)


class WrongJob(ProtocolError):
    """An authentic message for a job this receiver does not serve (``kind``: what it was)."""

    def __init__(self, job: str, kind: str) -> None:
        super().__init__(f"wrong job: {job!r}")
        self.job, self.kind = job, kind


class StaleMessage(ProtocolError):
    """An authentic message whose time is outside the replay window: a replay, or a sender
    whose clock is off this one's by ``skew_s`` (its time minus ours)."""

    def __init__(self, message: str, *, skew_s: float, job: str) -> None:
        super().__init__(message)
        self.skew_s = skew_s
        self.job = job


@dataclass
class DropCounter:
    """Why messages were dropped, by reason; shown in status and metrics."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class Codec:
    """Signs outgoing and verifies incoming messages for one sender identity.

    ``jobs`` limits which job ids are accepted (None: any job, used by a standalone
    coordinator that serves several). Replay protection: per sender, ``seq`` must grow and
    ``ts`` must be within ``window_s`` of our clock. A restarted sender starts a new
    identity (its ``sender`` includes a random incarnation), so growth per sender is sound.

    ``follows_clock`` (an agent, a status client): a node whose clock is off the coordinator's
    by more than the window would have every message dropped. The coordinator answers such a
    message with a ``reject`` carrying its ``clock``; a codec that follows adopts it (its
    messages then carry the coordinator's time: ``offset_s``). Only a signed reject with a clock
    moves it, and a replayed one is put right by the next.
    """

    def __init__(
        self,
        key: bytes,
        sender: str,
        *,
        job: str,
        accept_jobs: set[str] | None = None,
        window_s: float = 120.0,
        clock: Callable[[], float] = time.time,
        follows_clock: bool = False,
    ) -> None:
        if not key:
            raise ProtocolError("empty job secret")
        self.key = key
        self.sender = sender
        self.job = job
        self.accept_jobs = accept_jobs if accept_jobs is not None else {job}
        self.window_s = window_s
        self._wall = clock
        self.follows_clock = follows_clock
        self.offset_s = 0.0  # added to our clock: the coordinator's time, once a reject gave it
        self._seq = 0
        self._last_seq: dict[str, int] = {}
        self.dropped = DropCounter()

    def clock(self) -> float:
        return self._wall() + self.offset_s

    def encode(self, kind: str, body: dict[str, Any], *, job: str | None = None) -> bytes:
        problem = schema_errors(kind, body)
        if problem is not None:  # a bug on our side: never send what peers must drop
            raise ProtocolError(f"refusing to send invalid {kind!r}: {problem}")
        self._seq += 1
        payload = {"v": PROTOCOL_VERSION, "kind": kind, "job": job or self.job, "sender": self.sender,
                   "seq": self._seq, "ts": self.clock(), "body": body}
        payload["mac"] = sign(self.key, payload)
        raw = _canonical(payload)
        if len(raw) > MAX_MESSAGE_BYTES:  # the peer would drop it, and the sender wait for an answer forever
            raise ProtocolError(f"refusing to send {kind!r}: {len(raw)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
        return raw

    def decode(self, raw: bytes) -> Message:
        """Verify and parse one message; raise ProtocolError (and count it) if it must be dropped."""
        try:
            return self._decode(raw)
        except ProtocolError as err:
            self.dropped.add(str(err).split(":")[0])
            raise

    def _decode(self, raw: bytes) -> Message:
        if len(raw) > MAX_MESSAGE_BYTES:
            raise ProtocolError("too large: message over the size limit")
        try:  # read before the signature is: anything may come
            obj = strict_loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ProtocolError("malformed: not JSON") from None
        if not isinstance(obj, dict) or set(obj) != _ENVELOPE_KEYS:
            raise ProtocolError("malformed: not an envelope")
        if obj["v"] != PROTOCOL_VERSION:  # said to the user: a claimed version of any size is clipped
            shown = repr(obj["v"])
            shown = shown if len(shown) <= 24 else f"{shown[:20]}..."
            raise ProtocolError(f"version: unsupported protocol version {shown}")
        mac = obj.pop("mac")
        try:
            expected = sign(self.key, obj)
        except (ValueError, TypeError, RecursionError):  # e.g. nested deeper than the encoder goes
            raise ProtocolError("malformed: not canonical JSON") from None
        # compare_digest raises on a non-ASCII str: that is a bad signature too (acceptance 21C F2)
        if not isinstance(mac, str) or not mac.isascii() or not hmac.compare_digest(mac, expected):
            raise ProtocolError("unauthenticated: bad or missing signature")
        kind, job, sender, seq, ts, body = (obj[k] for k in ("kind", "job", "sender", "seq", "ts", "body"))
        if not isinstance(kind, str) or not isinstance(job, str) or not isinstance(sender, str):
            raise ProtocolError("malformed: bad header types")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(ts, (int, float)):
            raise ProtocolError("malformed: bad seq or ts")
        if self.accept_jobs and job not in self.accept_jobs:
            raise WrongJob(job, kind)
        skew_s = ts - self.clock()
        if abs(skew_s) > self.window_s:
            clock = body.get("clock") if kind == "reject" and isinstance(body, dict) else None
            if not (self.follows_clock and isinstance(clock, (int, float)) and not isinstance(clock, bool)):
                raise StaleMessage("stale: timestamp outside the replay window", skew_s=skew_s, job=job)
            self.offset_s = float(clock) - self._wall()
        if seq <= self._last_seq.get(sender, 0):
            raise ProtocolError("replayed: sequence number not increasing")
        problem = schema_errors(kind, body)
        if problem is not None:
            raise ProtocolError(f"schema: {kind}: {problem}")
        self._last_seq[sender] = seq
        return Message(kind=kind, job=job, sender=sender, seq=seq, ts=float(ts), body=body)
