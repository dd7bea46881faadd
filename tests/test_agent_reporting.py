"""What an agent's heartbeats say of its ranks' activity (the other nodes' hang thresholds use it)."""

from __future__ import annotations

from typing import Any

from unicron.agent.reporting import Reporter
from unicron.events import EventLog
from unicron.proto.messages import Codec

KEY = b"k" * 32


class _Dealer:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes, flags: int = 0) -> None:
        self.sent.append(data)


class _UI:
    def update(self, workers: list[Any], **job: Any) -> None:
        pass

    def warn(self, text: str) -> None:
        pass


def test_a_node_whose_workers_wait_for_the_zygote_says_busy(tmp_path) -> None:
    """An attempt assigned, its workers not started yet (the zygote still imports): the other
    nodes' ranks wait for these, so the job is busy, and no idle hang verdict blames them."""
    events = EventLog(tmp_path / "events.jsonl", job="j")
    reporter = Reporter(Codec(KEY, "n1", job="j"), node_id="n1", host="h", heartbeat_interval_s=1.0,
                        events=events, ui=_UI())
    reporter.dealer = _Dealer()  # type: ignore[assignment]
    codec = Codec(KEY, "coordinator", job="j")
    reporter.heartbeat(None, epoch=1, now=10.0, at_once=True)
    reporter.heartbeat(None, epoch=1, now=10.1, starting=True)  # a change of activity goes out at once
    sent = [codec.decode(raw) for raw in reporter.dealer.sent]  # type: ignore[attr-defined]
    assert [m.body["activity"] for m in sent if m.kind == "heartbeat"] == ["idle", "busy"]
    events.close()


def test_health_evidence_goes_out_after_the_failure_it_may_explain(tmp_path) -> None:
    """The coordinator stops an attempt on the first fault it hears and names it as the reason:
    a host note kept as evidence (another process OOM-killed) must not be that first fault."""
    events = EventLog(tmp_path / "events.jsonl", job="j")
    reporter = Reporter(Codec(KEY, "n1", job="j"), node_id="n1", host="h", heartbeat_interval_s=1.0,
                        events=events, ui=_UI())
    reporter.dealer = _Dealer()  # type: ignore[assignment]
    note = {"kind": "health", "node": "n1", "ts": 5.0, "error": "oom_kill: kernel OOM killer killed 1 process(es)"}
    reporter.health.evidence.append(note)
    crash = {"kind": "exit", "rank": 1, "exitcode": -11, "ts": 9.0}
    reporter.report(crash, None)
    codec = Codec(KEY, "coordinator", job="j")
    sent = [codec.decode(raw).body["fault"] for raw in reporter.dealer.sent]  # type: ignore[attr-defined]
    assert [f["kind"] for f in sent] == ["exit", "health"]
    assert sent[1]["error"] == note["error"] and sent[1]["attempt"] == -1
    assert not reporter.health.evidence  # taken: it goes with this failure only
    assert [f["kind"] for f in reporter.attempt_faults] == ["exit", "health"]  # a resume tells both
    events.close()
