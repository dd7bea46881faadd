"""The worker channel never blocks training: a full queue drops and counts."""

from __future__ import annotations

import json
import time

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


def test_the_agent_drops_a_datagram_whose_numbers_no_coordinator_could_sign(tmp_path) -> None:
    # NaN, Infinity and 1e400 are taken by json.loads but cannot be signed on the mesh: a fault
    # carrying one would end the agent when it reports it. They are garbage, dropped and counted.
    import zmq

    from unicron.agent.inbox import WorkerInbox

    class Sink:
        def __init__(self) -> None:
            self.got: list[dict] = []

        def on_message(self, msg: dict, now: float) -> None:
            self.got.append(msg)

    ctx = zmq.Context.instance()
    inbox = WorkerInbox(ctx, f"ipc://{tmp_path}/agent.sock")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"ipc://{tmp_path}/agent.sock")
    try:
        for raw in (b'{"t":"step","step":NaN}', b'{"t":"exc","ts":1e400}', b'{"t":"step","x":-Infinity}',
                    b'{"t":"step","step":4}'):
            push.send(raw)
        sink = Sink()
        deadline = time.monotonic() + 10
        while len(sink.got) + inbox.dropped < 4 and time.monotonic() < deadline:
            inbox.pull.poll(100)
            inbox.read(sink)
        assert sink.got == [{"t": "step", "step": 4}] and inbox.dropped == 3
    finally:
        push.close(0)
        inbox.close()


def test_worker_messages_of_the_wrong_shape_are_dropped_not_applied() -> None:
    """Acceptance 27C F4: an ``exc`` with ``"fatal": "yes"`` and numbers for its text, written
    on the channel by a script, failed a job whose workers all exited 0."""
    from unicron.agent.inbox import well_formed

    good = [{"t": "exc", "type": "KeyError", "msg": "'k'", "tb": "", "fatal": True, "ready": False},
            {"t": "exc", "type": "E", "msg": "", "tb": "", "fatal": False, "pending": True},
            {"t": "step", "step": 3, "snap": None}, {"t": "step", "step": 3, "snap": 2},
            {"t": "exiting", "code": 3, "pending": True}, {"t": "closed"}, {"t": "closed", "raising": True},
            {"t": "hello", "anything": [1]}]
    bad = [{"t": "exc", "rank": 0, "type": 5, "msg": [1], "tb": {}, "fatal": "yes"},
           {"t": "exc", "type": "E", "msg": "m", "tb": "t", "fatal": "yes"},
           {"t": "exc", "type": "E", "msg": "m"}, {"t": "step"}, {"t": "step", "step": True},
           {"t": "step", "step": -4}, {"t": "step", "step": 1.5}, {"t": "step", "step": 2, "snap": "2"},
           {"t": "exiting", "code": "3"}, {"t": "exiting"}, {"t": "closed", "raising": 1}]
    assert all(well_formed(m) for m in good)
    assert not any(well_formed(m) for m in bad)
