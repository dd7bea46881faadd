"""What the job core asks its shell to do. The core never touches sockets or files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Send:
    """Send message ``kind`` with ``body`` to one node."""

    node_id: str
    kind: str
    body: dict[str, Any]


@dataclass(frozen=True)
class OpenStore:
    """Open a fresh TCPStore for ``attempt`` and call ``JobCore.start_attempt`` with it. With a
    ``port``: open the store of ``attempt``, taken back after a restart, again where its ranks
    look for it (``addr``, as its assign said: "" for this coordinator's), and call
    ``unicron.coord.resume.store_opened_again``."""

    attempt: int
    port: int = 0
    addr: str = ""


@dataclass(frozen=True)
class Emit:
    """Record an event in the run's JSONL log."""

    kind: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finish:
    """The job is over: tell every node, then stop serving it."""

    exit_code: int
    reason: str


Out = Send | OpenStore | Emit | Finish
