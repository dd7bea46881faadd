"""The worker channel never blocks training: a full queue drops and counts."""

from __future__ import annotations

import json

from helpers_worker import agent_socket

from unicron.worker.channel import Channel


def test_agent_absent_messages_dropped_and_counted(tmp_path) -> None:
    # Nobody ever binds this endpoint: the queue fills to the high-water mark, then drops.
    ch = Channel(f"ipc://{tmp_path}/nobody.sock", rank=0, hwm=5, linger_ms=0)
    results = [ch.emit("step", step=i) for i in range(100)]
    assert ch.dropped > 0 and ch.sent + ch.dropped == 100 and results.count(False) == ch.dropped
    ch.close()
    ch.close()  # idempotent
    assert not ch.active and ch.emit("step", step=101) is False


def test_messages_reach_the_agent_in_order() -> None:
    with agent_socket() as agent:
        ch = Channel(agent.addr, rank=3)
        assert ch.emit("hello", local_rank=1, pid=42) and ch.emit("step", step=1)
        ch.close()
        agent.wait_for(lambda m: m["t"] == "step")
    hello, step = agent.messages
    assert set(hello) == {"t", "rank", "local_rank", "pid", "ts"} and hello["rank"] == 3
    assert set(step) == {"t", "rank", "step", "ts"} and step["step"] == 1
    assert json.loads(json.dumps(step)) == step


def test_no_address_is_a_noop() -> None:
    ch = Channel(None, rank=0)
    assert not ch.active and ch.emit("step", step=1) is False and ch.sent == ch.dropped == 0
    ch.close()


def test_urgent_messages_ring_the_doorbell_and_still_come_in_order() -> None:
    with agent_socket() as agent:
        ch = Channel(agent.addr, rank=1)
        assert ch.emit("step", step=1) and ch.emit("step", step=2)
        assert not agent.bell.poll(200)  # steps wait for the agent's next batch: no ring
        assert ch.emit("exc", type="RuntimeError", msg="boom", tb="", fatal=True)
        assert agent.bell.poll(10_000) and agent.bell.recv() == b""  # a ring carries nothing
        ch.close()
        agent.wait_for(lambda m: m["t"] == "exc")
    assert [m["t"] for m in agent.messages] == ["step", "step", "exc"]
