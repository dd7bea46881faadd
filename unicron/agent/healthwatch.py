"""The node's health readings as evidence for the classifier (the agent's side of detect.health)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unicron.detect.faults import Fault

HEALTH_EVERY_S = 2.0
HEALTH_EVIDENCE_S = 60.0


class HealthWatch:
    """Keeps the latest reading and recent changes in it.

    A change that is itself a failure (a hardware Xid, new uncorrectable ECC errors, a lost GPU:
    SEV1) is reported at once; the others (an OOM kill, memory pressure, throttling) are kept
    for ``HEALTH_EVIDENCE_S`` and travel with the next worker failure, which they may explain
    (an OOM kill turns a SIGKILL into 'oom-killer').
    """

    def __init__(self) -> None:
        self.reading: dict[str, Any] = {}
        self.evidence: list[dict[str, Any]] = []
        self._last_read = 0.0

    def due(self, now_mono: float) -> bool:
        if now_mono - self._last_read < HEALTH_EVERY_S:
            return False
        self._last_read = now_mono
        return True

    def update(self, reading: dict[str, Any], *, node: str, host: str, attempt: int,
               running: bool) -> tuple[list[dict[str, Any]], list[Fault]]:
        """Take a new reading; returns (faults to report now, changes kept as evidence)."""
        # Imported on the first reading, not at agent start: the launch path stays short.
        from unicron.detect.classify import classify
        from unicron.detect.faults import Severity
        from unicron.detect.health import health_faults

        reading.setdefault("ts", time.time())
        found = health_faults(self.reading or None, reading, node=node, host=host, attempt=attempt)
        self.reading = reading
        cutoff = time.time() - HEALTH_EVIDENCE_S
        self.evidence = [f for f in self.evidence if f["ts"] >= cutoff]
        report: list[dict[str, Any]] = []
        kept: list[Fault] = []
        for fault in found:
            if classify(fault).severity is Severity.SEV1 and running:
                report.append(fault.to_dict())
            else:
                self.evidence.append(fault.to_dict())
                kept.append(fault)
        return report, kept

    def with_oom_kills_now(self) -> dict[str, Any] | None:
        """The last reading with the kernel's OOM-kill count read again now (a few microseconds);
        None before the first reading. A SIGKILLed worker is seen within milliseconds, its
        OOM kill only at the next reading, up to ``HEALTH_EVERY_S`` later: after the decision."""
        if not self.reading or "oom_kills" not in self.reading:
            return None
        from unicron.detect.health import read_oom_kills

        return dict(self.reading, oom_kills=read_oom_kills(), ts=time.time())

    def take_evidence(self) -> list[dict[str, Any]]:
        evidence, self.evidence = self.evidence, []
        return evidence


def read_health_safely() -> dict[str, Any]:
    """This host's health reading, or the error that prevented it (health is best effort: it
    never stops the agent)."""
    try:
        from unicron.detect.health import read_health

        return dict(read_health())
    except Exception as err:
        return {"error": str(err)}
