"""Wire protocol: signing, schema checks, replay protection, and a live coordinator that
survives garbage."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import zmq

from unicron.coord.decide import DetectDecider
from unicron.coord.server import CoordinatorServer
from unicron.errors import EndpointUnreachableError, ProtocolError
from unicron.events import EventLog
from unicron.proto.client import request
from unicron.proto.messages import PROTOCOL_VERSION, Codec, sign

KEY = b"k" * 32


def _codecs(clock=None):
    kwargs = {"clock": clock} if clock else {}
    return Codec(KEY, "a", job="j", **kwargs), Codec(KEY, "b", job="j", **kwargs)


def test_roundtrip_and_replay() -> None:
    sender, receiver = _codecs()
    raw = sender.encode("leave", {"node_id": "n", "reason": "bye"})
    msg = receiver.decode(raw)
    assert (msg.kind, msg.job, msg.sender, msg.body["reason"]) == ("leave", "j", "a", "bye")
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode(raw)
    assert receiver.dropped.counts == {"replayed": 1}


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda env: env.update(mac="00" * 32), "unauthenticated"),
        (lambda env: env.pop("mac"), "malformed"),
        (lambda env: env.update(v=99), "version"),
        (lambda env: env["body"].update(reason=5), "unauthenticated"),  # tampered after signing
    ],
)
def test_tampered_messages_are_dropped(mutate, reason) -> None:
    sender, receiver = _codecs()
    env = json.loads(sender.encode("leave", {"node_id": "n", "reason": "bye"}))
    mutate(env)
    with pytest.raises(ProtocolError, match=reason):
        receiver.decode(json.dumps(env).encode())


def _signed(payload: dict) -> bytes:
    payload = dict(payload)
    payload["mac"] = sign(KEY, payload)
    return json.dumps(payload).encode()


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"node_id": "n"}, "missing field 'reason'"),
        ({"node_id": "n", "reason": 3}, "field 'reason' has type int"),
        ({"node_id": "n", "reason": "x", "evil": 1}, "unexpected field"),
    ],
)
def test_schema_violations_signed_correctly_still_dropped(body, reason) -> None:
    _, receiver = _codecs()
    raw = _signed({"v": PROTOCOL_VERSION, "kind": "leave", "job": "j", "sender": "s", "seq": 1, "ts": receiver.clock(), "body": body})
    with pytest.raises(ProtocolError, match=reason):
        receiver.decode(raw)


def test_unknown_kind_wrong_job_and_stale() -> None:
    _, receiver = _codecs()
    now = receiver.clock()
    base = {"v": PROTOCOL_VERSION, "job": "j", "sender": "s", "ts": now, "body": {}}
    with pytest.raises(ProtocolError, match="unknown kind"):
        receiver.decode(_signed({**base, "kind": "rm -rf", "seq": 1}))
    with pytest.raises(ProtocolError, match="wrong job"):
        receiver.decode(_signed({**base, "kind": "status_req", "job": "other", "seq": 2}))
    with pytest.raises(ProtocolError, match="stale"):
        receiver.decode(_signed({**base, "kind": "status_req", "seq": 3, "ts": now - 3600}))
    for garbage in (b"", b"\xff\xfe", b"[1,2]", b"null", b'{"v":1}', b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ProtocolError):
            receiver.decode(garbage)


def test_a_fault_whose_text_fields_are_not_text_is_refused() -> None:
    """What a fault says comes from a worker: the coordinator relies on its types."""
    sender, receiver = _codecs()
    good = {"kind": "exception", "ts": 1.0, "rank": 0, "attempt": 0, "message": "boom", "traceback": "tb",
            "progress": 3, "into_attempt_s": 1.5}  # fields beyond the checked ones ride along
    receiver.decode(sender.encode("fault", {"node_id": "n", "attempt": 0, "fault": good}))
    for field, value in (("traceback", 7), ("message", {"a": 1}), ("rank", "0"), ("culprit_ranks", "1")):
        with pytest.raises(ProtocolError, match=f"fault.{field}"):
            sender.encode("fault", {"node_id": "n", "attempt": 0, "fault": {**good, field: value}})


def _join_body(node: str) -> dict:
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 2,
            "max_nodes": 2, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": 30,
            "join_timeout_s": 60, "stop_timeout_s": 5}


_FAULT = {"kind": "exit", "ts": 1.0, "rank": 0, "attempt": 0, "exitcode": 1}
_ASSIGN = {"epoch": 1, "attempt": 0, "restart_count": 0, "node_rank": 0, "nnodes": 1, "rank_offset": 0,
           "world_size": 2, "local_world_sizes": [2], "master_addr": "h", "master_port": 1, "inject": False,
           "nodes": [["n", "h"]], "restarts_used": 0}
_RESUME = {"attempt": 0, "nodes": [["n", "h"]], "local_world_sizes": [1], "restarts_used": 0, "epoch": 1,
           "state": "running", "faults": [dict(_FAULT, kind="martian")]}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind, body, reason", [
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, kind="martian")}, "unknown fault kind 'martian'"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, gpu="x")}, "fault.gpu"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, culprit_ranks=[None])}, "culprit_ranks"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, culprit_ranks=[True])}, "culprit_ranks"),
    # Values no agent sends (30B F2: each restarted the job, "rank -1 ... exited with code 1").
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, rank=-1)}, "'rank' must be in [0, "),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, rank=2**62)}, "'rank' must be in [0, "),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, culprit_ranks=[-1])}, "culprit_ranks"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, signal=2**62)}, "'signal' must be in [1, 255]"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, exitcode=-(2**62))}, "'exitcode'"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, gpu=-1)}, "'gpu'"),
    ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, attempt=-3)}, "'attempt'"),
    ("heartbeat", {"node_id": "n", "epoch": 1, "attempt": 0, "workers": [1], "health": {}}, "workers"),
    ("stopped", {"node_id": "n", "attempt": 0, "snapshots": {}, "stacks": {"x": "dump"}}, "stacks"),
    ("stopped", {"node_id": "n", "attempt": 0, "snapshots": {}, "stacks": {"0": 1}}, "stacks"),
    ("assign", dict(_ASSIGN, local_world_sizes=["2"]), "local_world_sizes"),
    ("assign", dict(_ASSIGN, node_rank=1), "local_world_sizes"),
])
def test_values_inside_a_message_that_no_handler_takes_are_refused_at_receipt(kind, body, reason) -> None:
    """Acceptance 29B F1: a signed fault of kind "martian" passed the schema, and failed the
    whole job when its tick read it. What a handler would fail on later is dropped at receipt
    (and never sent)."""
    sender, receiver = _codecs()
    raw = _signed({"v": PROTOCOL_VERSION, "kind": kind, "job": "j", "sender": "s", "seq": 1, "ts": receiver.clock(),
                   "body": body})
    with pytest.raises(ProtocolError, match=re.escape(reason)):
        receiver.decode(raw)
    assert receiver.dropped.counts == {"schema": 1}
    with pytest.raises(ProtocolError, match="refusing to send"):
        sender.encode(kind, body)


@pytest.mark.timeout(10)
def test_what_agents_send_passes_the_value_checks() -> None:
    sender, receiver = _codecs()
    for kind, body in [
        ("fault", {"node_id": "n", "attempt": 0, "fault": dict(_FAULT, signal="SIGKILL", culprit_ranks=[1], gpu=None,
                                                               node=None, latency_s=0.5)}),
        ("heartbeat", {"node_id": "n", "epoch": 1, "attempt": 0, "workers": [{"rank": 0}], "health": {}}),
        ("stopped", {"node_id": "n", "attempt": 0, "snapshots": {}, "stacks": {"0": "dump", "12": ""}}),
        ("assign", _ASSIGN),
        ("join", {**_join_body("n"), "resume": dict(_RESUME, faults=[_FAULT])}),
    ]:
        assert receiver.decode(sender.encode(kind, body)).body == body


def test_a_peer_of_another_protocol_version_is_refused() -> None:
    """Version 2 added fields to join and reject: a version 1 peer would half understand them."""
    _, receiver = _codecs()
    old = _signed({"v": 1, "kind": "status_req", "job": "j", "sender": "s", "seq": 1, "ts": receiver.clock(),
                   "body": {}})
    with pytest.raises(ProtocolError, match="unsupported protocol version 1"):
        receiver.decode(old)


def test_bool_is_not_an_int() -> None:
    _, receiver = _codecs()
    raw = _signed({"v": PROTOCOL_VERSION, "kind": "welcome", "job": "j", "sender": "s", "seq": 1, "ts": receiver.clock(),
                   "body": {"node_id": "n", "epoch": True}})
    with pytest.raises(ProtocolError, match="bool"):
        receiver.decode(raw)


def test_sender_refuses_to_send_invalid() -> None:
    sender, _ = _codecs()
    with pytest.raises(ProtocolError):
        sender.encode("leave", {"node_id": "n"})


@pytest.fixture
def live_coordinator(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", job="j")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"})
    server.start()
    yield server
    server.stop()
    events.close()


def _unsigned(ts: str, body: str = "{}") -> bytes:
    return (f'{{"v":{PROTOCOL_VERSION},"kind":"status_req","job":"j","sender":"x","seq":1,"ts":{ts},'
            f'"body":{body},"mac":"00"}}').encode()


@pytest.mark.parametrize("raw", [_unsigned("NaN"), _unsigned("1e400"), _unsigned("1.0", body='{"a":Infinity}'),
                                 _unsigned("1" + "0" * 400), _unsigned("1.0", body='{"step":' + "9" * 30 + "}")])
def test_what_json_takes_but_no_peer_can_sign_is_malformed(raw: bytes) -> None:
    """Integers past 64 bits too: float() of one overflows where its time or step is used."""
    _, receiver = _codecs()
    with pytest.raises(ProtocolError, match="malformed"):
        receiver.decode(raw)


def test_a_signature_with_characters_past_ascii_is_a_bad_signature() -> None:
    """``hmac.compare_digest`` raises TypeError on such a str; it printed a traceback for every
    message anyone sent so (acceptance 21C F2)."""
    _, receiver = _codecs()
    with pytest.raises(ProtocolError, match="unauthenticated"):
        receiver.decode(_unsigned("1.0").replace(b'"mac":"00"', '"mac":"\u00e9"'.encode()))


def test_a_claimed_version_is_clipped_in_what_the_user_is_told() -> None:
    """Anyone who reaches the port chooses it: 2 MB of it was printed whole (acceptance 21C F3)."""
    _, receiver = _codecs()
    raw = _unsigned("1.0").replace(f'"v":{PROTOCOL_VERSION}'.encode(), b'"v":"' + rb"\u001b[2J" + b"V" * 100_000 + b'"')
    with pytest.raises(ProtocolError, match="version") as caught:
        receiver.decode(raw)
    assert len(str(caught.value)) < 100 and r"\x1b" in str(caught.value)  # escaped, as repr does


def test_a_body_nested_as_deep_as_json_reads_is_dropped_whatever_the_depth() -> None:
    # Somewhere below json's own limit the signature check's re-encoding, one frame deeper,
    # runs out of stack: every depth is a dropped message, never a RecursionError.
    _, receiver = _codecs()
    for depth in range(900, 1100):
        with pytest.raises(ProtocolError):
            receiver.decode(_unsigned("1.0", body="[" * depth + "]" * depth))


def test_a_node_whose_clock_is_off_takes_the_coordinators_time(tmp_path) -> None:
    # Messages carry wall-clock time against replays. A node 200 s ahead would have every
    # message dropped (torchrun does not care): the coordinator answers with its clock, which
    # the node's codec adopts, and says so once on its console.
    events = EventLog(tmp_path / "events.jsonl", job="j")
    warnings: list[str] = []
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"}, warn=warnings.append)
    server.start()
    try:
        ep = f"127.0.0.1:{server.port}"
        ahead = Codec(KEY, "ahead", job="j", clock=lambda: time.time() + 200)
        with pytest.raises(ProtocolError, match="stale"):  # a codec that does not follow drops the answer
            ahead.decode(server.codec.encode("reject", {"reason": "r", "clock": time.time()}, job="j"))
        follower = Codec(KEY, "f", job="j", clock=lambda: time.time() + 200, follows_clock=True)
        follower.decode(server.codec.encode("reject", {"reason": "r", "clock": time.time()}, job="j"))
        assert abs(follower.clock() - time.time()) < 5 and abs(follower.offset_s + 200) < 5
        with pytest.raises(ProtocolError, match="stale"):  # only a reject with a clock moves it
            Codec(KEY, "g", job="j", clock=lambda: time.time() + 200, follows_clock=True).decode(
                server.codec.encode("welcome", {"node_id": "n", "epoch": 1}, job="j"))
        import unicron.proto.client as client
        real = client.Codec
        client.Codec = lambda *a, **k: real(*a, clock=lambda: time.time() + 200, **k)  # type: ignore[misc]
        try:
            welcome = request(ep, "join", _join_body("n1"), job="j", key=KEY, timeout_s=5, expect="welcome")
            status = request(ep, "status_req", {}, job="j", key=KEY, timeout_s=5, expect="status")
        finally:
            client.Codec = real  # type: ignore[misc]
        assert welcome.body["node_id"] == "n1" and status.body["snapshot"]["job"]["state"] == "waiting"
        # Once per peer (each request is a socket of its own), naming how far off it is.
        assert len(warnings) == 2 and all(re.search(r"clock is (199|200) s ahead of the coordinator's .*NTP", w)
                                          for w in warnings), warnings
    finally:
        server.stop()
        events.close()


def test_coordinator_survives_garbage_and_keeps_serving(live_coordinator) -> None:
    ep = f"127.0.0.1:{live_coordinator.port}"
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.DEALER)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(f"tcp://{ep}")
    wrong_key = Codec(b"x" * 32, "evil", job="j")
    garbage = [b"", b"not json", b"{}", b"\x00" * 1000, json.dumps({"v": 1}).encode(),
               wrong_key.encode("join", _join_body("evil")),
               # deeper than json parses: it used to raise RecursionError, which ended the thread
               b"[" * 200_000 + b"]" * 200_000,
               # no secret needed: what json.loads takes but the signature check cannot re-encode
               # (NaN, an overflowing float, a body nested just short of json's limit) ended it too
               *(_unsigned(ts) for ts in ("NaN", "Infinity", "-Infinity", "1e400")),
               *(_unsigned("1.0", body="[" * depth + "]" * depth) for depth in range(975, 1000, 3))]
    for raw in garbage:
        attacker.send(raw)
    attacker.send_multipart([b"a", b"b", b"c"])
    # A join signed with the real key is served; the garbage was counted, nothing crashed.
    msg = request(ep, "join", _join_body("n1"), job="j", key=KEY, timeout_s=5, expect="welcome")
    assert msg.body["node_id"] == "n1"
    # The garbage came on a connection of its own, which the coordinator fair-queues with the
    # requests' connections: a request can overtake what the attacker sent (the 400 kB message is
    # still in flight on a busy machine), so the count is polled, not read once.
    deadline = time.monotonic() + 20
    while True:
        status = request(ep, "status_req", {}, job="j", key=KEY, timeout_s=5, expect="status")
        snap = status.body["snapshot"]
        if snap["job"]["dropped_messages"] >= len(garbage) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert snap["job"]["state"] == "waiting"
    assert snap["job"]["dropped_messages"] >= len(garbage)
    assert [n["host"] for n in snap["nodes"]] == ["127.0.0.1"]
    attacker.close(0)
    assert live_coordinator.thread is not None and live_coordinator.thread.is_alive()


def test_a_node_with_another_secret_or_version_is_reported_once(tmp_path) -> None:
    events = EventLog(tmp_path / "events.jsonl", job="j")
    warnings: list[str] = []
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"}, warn=warnings.append)
    server.start()
    ctx = zmq.Context.instance()
    other_key = Codec(b"x" * 32, "a", job="j")
    newer = {"v": 99, "kind": "join", "job": "j", "sender": "c", "seq": 1, "ts": time.time(), "body": _join_body("c")}
    sends = {b"node-a": [other_key.encode("join", _join_body("a")), other_key.encode("join", _join_body("a"))],
             b"node-b": [b"not json"],  # garbage: counted, not worth a line
             b"node-c": [_signed(newer)]}
    socks = []
    try:
        for identity, raws in sends.items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IDENTITY, identity)
            sock.connect(f"tcp://127.0.0.1:{server.port}")
            for raw in raws:
                sock.send(raw)
            socks.append(sock)
        deadline = time.monotonic() + 10
        while server.codec.dropped.total < 4 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling for the coordinator's thread to have read all four
        assert server.codec.dropped.total == 4, server.codec.dropped.counts
    finally:
        for sock in socks:
            sock.close(0)
        server.stop()
        events.close()
    assert len(warnings) == 2, warnings
    by_peer = {w.split()[3].rstrip(":"): w for w in warnings}
    assert set(by_peer) == {"node-a", "node-c"}, warnings
    assert "another secret" in by_peer["node-a"] and "UNICRON_SECRET" in by_peer["node-a"]
    assert "same unicron version" in by_peer["node-c"]


def test_status_against_silent_endpoint_times_out() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()
    try:
        with pytest.raises(EndpointUnreachableError, match="no answer"):
            request(f"127.0.0.1:{port}", "status_req", {}, job="j", key=KEY, timeout_s=0.5)
        done.set()
    finally:
        silent.close(0)
    assert done.is_set()
