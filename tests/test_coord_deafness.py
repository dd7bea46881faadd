"""A coordinator that hears no node of any job (``unicron.coord.deafness``,
``unicron.coord.hearing``): pure, and in the coordinator's real loop, where the silence of
everyone at once whose hosts do not answer either is its own and loses nobody, while one node
silent among others heard, or nodes whose hosts answer, are lost as before. A coordinator
embedded in a node hears that node whatever the network does: its word does not count."""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from e2e import wait_for

from unicron.coord.deafness import DeafWatch, allowance_s
from unicron.coord.decide import DetectDecider
from unicron.coord.hearing import hosts_probe
from unicron.coord.outbox import Emit
from unicron.coord.server import CoordinatorServer
from unicron.events import EventLog
from unicron.netprobe import Prober, hosts_answer
from unicron.proto.client import request
from unicron.proto.messages import Codec

KEY = b"k" * 32
pytestmark = pytest.mark.timeout(60)


def test_the_allowance_sits_between_a_heartbeat_gap_and_the_timeout() -> None:
    assert allowance_s(0.5, 3.0) == 2.0  # the defaults
    assert allowance_s(1.0, 5.0) == 3.0
    assert allowance_s(1.0, 3.0) is None  # no room between a heartbeat's gap and the timeout
    assert allowance_s(1.0, 1.5) is None


def test_silence_of_everyone_is_excused_past_the_allowance_until_someone_is_heard() -> None:
    deaf = DeafWatch(100.0, cap_s=60.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    deaf.unanswered(101.0)  # a probe of the silent nodes' hosts, started after the last word, got no answer
    assert deaf.excuse("a", 101.9, nodes=2, **hb) == 0.0  # under the allowance (2 s)
    assert not deaf.spell_started("a")
    assert deaf.excuse("a", 103.0, nodes=2, **hb) == pytest.approx(1.0)
    assert deaf.spell_started("a") and not deaf.spell_started("b") and deaf.deaf_for("a")
    assert deaf.excuse("a", 103.5, nodes=2, **hb) == pytest.approx(0.5)  # only what is new
    assert deaf.excuse("b", 103.5, nodes=2, **hb) == pytest.approx(1.5)  # each job its own account
    assert deaf.deaf_s(103.5) == pytest.approx(3.5)
    assert deaf.heard(104.0) == {"a": pytest.approx(1.5), "b": pytest.approx(1.5)}
    assert not deaf.deaf_for("a")
    assert deaf.excuse("a", 107.0, nodes=2, **hb) == 0.0  # the old probe is no evidence for the new silence
    deaf.unanswered(103.9)
    assert deaf.excuse("a", 107.0, nodes=2, **hb) == 0.0
    assert deaf.heard(105.5) == {}


def test_silence_is_excused_only_on_a_probe_that_got_no_answer() -> None:
    """Launchers killed together are silent at once too; their hosts answer the probe, so the
    silence is theirs. Until a probe has come back empty, nothing is excused."""
    deaf = DeafWatch(0.0, cap_s=60.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    assert deaf.excuse("a", 10.0, nodes=2, **hb) == 0.0 and not deaf.deaf_for("a")
    assert deaf.heard(1.0) == {}  # a probe that started at 1.0 was answered: the network worked then
    assert deaf.heard(0.5) == {} and deaf.heard_at == 1.0  # older news changes nothing
    deaf.unanswered(0.8)  # started before the answer: no evidence
    assert deaf.excuse("a", 10.0, nodes=2, **hb) == 0.0
    deaf.unanswered(2.0)
    assert deaf.excuse("a", 10.0, nodes=2, **hb) == pytest.approx(7.0)


def test_one_nodes_silence_is_its_own_and_excuses_stop_at_the_cap() -> None:
    deaf = DeafWatch(0.0, cap_s=60.0)
    deaf.unanswered(1.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    assert deaf.excuse("a", 10.0, nodes=1, **hb) == 0.0
    assert deaf.excuse("a", 30.0, nodes=2, **hb) == pytest.approx(28.0)
    assert deaf.deaf_for("a")
    assert deaf.excuse("a", 500.0, nodes=2, **hb) == pytest.approx(32.0)  # 60 s in all, then no more
    assert not deaf.deaf_for("a")  # over: its acks stop saying deaf, its nodes are judged again
    assert deaf.excuse("a", 900.0, nodes=2, **hb) == 0.0


def test_a_spell_is_over_for_a_job_left_with_too_few_nodes() -> None:
    deaf = DeafWatch(0.0, cap_s=60.0)
    deaf.unanswered(1.0)
    hb = {"interval_s": 0.5, "timeout_s": 3.0}
    assert deaf.excuse("a", 5.0, nodes=2, **hb) == pytest.approx(3.0)
    assert deaf.excuse("a", 6.0, nodes=1, **hb) == 0.0 and not deaf.deaf_for("a")  # its silent nodes were lost
    assert deaf.excuse("a", 9.0, nodes=2, **hb) == 0.0  # a node that joins does not restart it
    assert deaf.heard(10.0) == {"a": pytest.approx(3.0)}


def test_a_stall_of_the_coordinator_is_not_excused_twice() -> None:
    deaf = DeafWatch(0.0, cap_s=60.0)
    deaf.paused(10.0)  # the stall watch excused 10 s already
    deaf.unanswered(11.0)
    assert deaf.excuse("a", 11.0, nodes=2, interval_s=0.5, timeout_s=3.0) == 0.0
    assert deaf.excuse("a", 13.0, nodes=2, interval_s=0.5, timeout_s=3.0) == pytest.approx(1.0)


# ---- in the real loop ------------------------------------------------------------------


def _join_body(node: str, timeout_s: float = 3) -> dict[str, Any]:
    # Three nodes wanted: the job waits, and only the coordinator's own clock judges silence.
    return {"node_id": node, "host": "127.0.0.1", "nproc": 1, "node_rank": None, "pid": 1, "min_nodes": 3,
            "max_nodes": 3, "max_restarts": 0, "last_call_s": 0, "heartbeat_timeout_s": timeout_s,
            "join_timeout_s": 60, "stop_timeout_s": 5}


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _heartbeat(sock: zmq.Socket, codec: Codec, node: str) -> None:
    sock.send(codec.encode("heartbeat", {"node_id": node, "epoch": 0, "attempt": -1, "workers": [], "health": {}}))


class Silence:
    """The answer of hosts cut off: none (the probe's connects are the only thing faked)."""

    def __init__(self) -> None:
        self.asked: list[set[tuple[str, int]]] = []

    def __call__(self, addresses: Any, timeout_s: float) -> bool:
        self.asked.append(set(addresses))
        return False


def _serve(tmp_path: Path, *, probe: Prober | None, pinned: tuple[str, ...] = ()) -> Any:
    log = tmp_path / "events.jsonl"
    events = EventLog(log, job="j")
    server = CoordinatorServer(KEY, bind_host="127.0.0.1", port=0, events_for=lambda _j: events,
                               decider_for=DetectDecider, jobs={"j"}, probe=probe)
    server.pinned.update(pinned)
    server.start()
    return server, events, log


@pytest.fixture
def served(tmp_path: Path) -> Any:
    silence = Silence()
    server, events, log = _serve(tmp_path, probe=hosts_probe(time.time, every_s=0.2, answer=silence))
    try:
        yield f"127.0.0.1:{server.port}", log
    finally:
        server.stop()
        events.close()
    assert all(asked == {("127.0.0.1", server.port)} for asked in silence.asked)  # silent nodes, at its port


def test_everyone_silent_at_once_loses_nobody_and_a_node_still_silent_after_is_lost(served: Any) -> None:
    """Both nodes fall silent together and their host answers no connect (the coordinator's link
    cut, in life) for longer than the heartbeat timeout: nobody is lost. Then n1 is heard again and n2 is not: n2 is lost, n1 not."""
    ep, log = served
    for node in ("n1", "n2"):
        request(ep, "join", _join_body(node), job="j", key=KEY, timeout_s=5, expect="welcome")
    joined = time.monotonic()
    wait_for(lambda: any(e["kind"] == "coordinator_deaf" for e in _events(log)), 15, "the coordinator to say it hears nobody")
    while time.monotonic() < joined + 5:  # well past the 3 s timeout, polling its view (not heard)
        snap = request(ep, "status_req", {}, job="j", key=KEY, timeout_s=5, expect="status").body["snapshot"]
        assert {n["node_id"]: n["state"] for n in snap["nodes"]} == {"n1": "healthy", "n2": "healthy"}
        time.sleep(0.2)
    # The view says so, and shows how long each node has really been silent, not the silence
    # left once the excused part is taken off (acceptance 22A F4: 2.3 s after 15 s of a cut).
    assert snap["job"].get("silence_excused") is True
    assert all(time.time() - n["last_heartbeat"] > 4.5 for n in snap["nodes"])
    assert not [e for e in _events(log) if e["kind"] == "node_lost"]
    deaf = next(e for e in _events(log) if e["kind"] == "coordinator_deaf")
    assert deaf["nodes"] == 2 and deaf["silent_s"] >= 2.0

    codec = Codec(KEY, "n1", job="j")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"n1-{os.urandom(4).hex()}".encode())
    sock.connect(f"tcp://{ep}")
    try:
        heard_at = time.monotonic()
        _heartbeat(sock, codec, "n1")

        def n2_lost() -> Any:
            _heartbeat(sock, codec, "n1")  # n1 goes on heartbeating every 0.1 s
            time.sleep(0.1)
            return [e for e in _events(log) if e["kind"] == "node_lost"]
        lost = wait_for(n2_lost, 15, "n2 to be lost")
    finally:
        sock.close(0)
    assert [e["node_id"] for e in lost] == ["n2"]
    # Its loss waits, from when n1 was heard, as long as the silence lasted (its TCP retransmits
    # back off that long), and then it is past its timeout.
    silent_s = heard_at - joined
    assert silent_s - 1 < time.monotonic() - heard_at < silent_s + 3
    again = [e for e in _events(log) if e["kind"] == "coordinator_hears_again"]
    assert len(again) == 1 and again[0]["excused_s"] > 0 and again[0]["grace_s"] > silent_s - 0.5


def test_a_lone_nodes_silence_is_its_own(served: Any) -> None:
    ep, log = served
    request(ep, "join", _join_body("n1"), job="j", key=KEY, timeout_s=5, expect="welcome")
    lost = wait_for(lambda: [e for e in _events(log) if e["kind"] == "node_lost"], 15, "n1 to be lost")
    assert [e["node_id"] for e in lost] == ["n1"]
    assert not [e for e in _events(log) if e["kind"] == "coordinator_deaf"]


@pytest.mark.parametrize("timeout_s", [3.0, 2.5])
def test_nodes_silent_together_whose_host_answers_are_lost_at_the_timeout(tmp_path: Path, timeout_s: float) -> None:
    """Launchers killed together fall silent at once too, but their host answers a connect
    (here 127.0.0.1, really probed): the silence is theirs, and they are lost as before. Also
    where the allowance (1.5 s at a 2.5 s timeout) leaves the probe little time: nothing is
    excused before a probe came back empty (the first version excused on time alone, then took
    the answer for the link's return, and never lost them)."""
    server, events, log = _serve(tmp_path, probe=None)
    try:
        ep = f"127.0.0.1:{server.port}"
        for node in ("n1", "n2"):
            request(ep, "join", _join_body(node, timeout_s), job="j", key=KEY, timeout_s=5, expect="welcome")
        joined = time.monotonic()
        lost = wait_for(lambda: len([e for e in _events(log) if e["kind"] == "node_lost"]) == 2 and
                        [e for e in _events(log) if e["kind"] == "node_lost"], 15, "both nodes to be lost")
        assert time.monotonic() - joined < timeout_s + 3
        assert sorted(e["node_id"] for e in lost) == ["n1", "n2"]
        assert not [e for e in _events(log) if e["kind"] == "coordinator_deaf"]
    finally:
        server.stop()
        events.close()


def _embedded(tmp_path: Path, others: tuple[str, ...]) -> Any:
    """A coordinator embedded in node n0 (pinned), whose agent heartbeats all along over
    loopback, with ``others`` joined and then silent, their hosts answering nothing."""
    server, events, log = _serve(tmp_path, probe=hosts_probe(time.time, every_s=0.2, answer=Silence()),
                                 pinned=("n0",))
    ep = f"127.0.0.1:{server.port}"
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"n0")
    sock.connect(f"tcp://{ep}")
    codec = Codec(KEY, "n0", job="j")
    sock.send(codec.encode("join", _join_body("n0")))
    for node in others:
        request(ep, "join", _join_body(node), job="j", key=KEY, timeout_s=5, expect="welcome")
    return server, events, log, sock, codec


def _acks_while_heartbeating(sock: zmq.Socket, codec: Codec, seconds: float) -> list[dict[str, Any]]:
    acks, until = [], time.monotonic() + seconds
    while time.monotonic() < until:
        _heartbeat(sock, codec, "n0")
        if sock.poll(200):
            msg = codec.decode(sock.recv())
            if msg.kind == "ack":
                acks.append(msg.body)
    return acks


def test_an_embedded_coordinator_that_hears_only_its_own_node_loses_nobody(tmp_path: Path) -> None:
    """The node it is embedded in is heard over loopback whatever the network does; n1 and n2,
    its only nodes over the network, fall silent together: the silence is taken for its own
    (acceptance 18C F6: every healthy node was declared lost), and its own agent is told."""
    server, events, log, sock, codec = _embedded(tmp_path, ("n1", "n2"))
    try:
        acks = _acks_while_heartbeating(sock, codec, 6.0)  # twice the heartbeat timeout
        assert not [e for e in _events(log) if e["kind"] == "node_lost"]
        deaf = next(e for e in _events(log) if e["kind"] == "coordinator_deaf")
        assert deaf["nodes"] == 2 and deaf["own_nodes"] == ["n0"]
        assert not acks[0].get("deaf") and acks[-1].get("deaf") is True
    finally:
        sock.close(0)
        server.stop()
        events.close()


def test_an_embedded_coordinators_one_other_node_is_lost_as_before(tmp_path: Path) -> None:
    """With one node besides its own, that node's silence is as likely its own: lost."""
    server, events, log, sock, codec = _embedded(tmp_path, ("n1",))
    try:
        def n1_lost() -> Any:
            _acks_while_heartbeating(sock, codec, 0.3)
            return [e for e in _events(log) if e["kind"] == "node_lost"]
        assert [e["node_id"] for e in wait_for(n1_lost, 15, "n1 to be lost")] == ["n1"]
        assert not [e for e in _events(log) if e["kind"] == "coordinator_deaf"]
    finally:
        sock.close(0)
        server.stop()
        events.close()


def test_a_host_answers_with_a_handshake_or_a_refusal_and_not_when_it_drops_the_connect() -> None:
    listening, refusing, dropping = socket.socket(), socket.socket(), socket.socket()
    fillers: list[socket.socket] = []
    try:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        refusing.bind(("127.0.0.1", 0))  # bound, not listening: the kernel refuses
        # A full accept queue: the kernel drops further connects without a word, as a link cut is silent.
        dropping.bind(("127.0.0.1", 0))
        dropping.listen(0)
        for _ in range(3):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(dropping.getsockname())
            fillers.append(filler)
        wait_for(lambda: not hosts_answer({dropping.getsockname()}, 0.2), 10, "the accept queue to fill")
        assert hosts_answer({listening.getsockname()}, 1.0)
        assert hosts_answer({refusing.getsockname()}, 1.0)
        started = time.monotonic()
        assert not hosts_answer({dropping.getsockname(), ("no-such-host.invalid", 1)}, 0.3)
        assert time.monotonic() - started < 5  # all at once, each within the timeout
        assert hosts_answer({dropping.getsockname(), refusing.getsockname()}, 0.3)  # any one is enough
    finally:
        for sock in (listening, refusing, dropping, *fillers):
            sock.close()


def test_the_probe_asks_at_its_pace_only_while_it_has_addresses() -> None:
    asked: list[float] = []
    answered = threading.Event()

    def answer(addresses: Any, timeout_s: float) -> bool:
        asked.append(time.monotonic())
        return answered.is_set()

    probe = Prober(answer, clock=time.monotonic, every_s=0.2, timeout_s=1.0)
    try:
        probe.want(set())
        assert not asked and probe.answered_at is None  # nothing to ask: no thread
        for _ in range(20):  # the server says what it wants every turn: that sets no faster pace
            probe.want({("10.0.0.2", 1)})
        wait_for(lambda: len(asked) >= 3, 10, "three probes")
        assert all(b - a >= 0.15 for a, b in itertools.pairwise(asked))
        assert probe.answered_at is None
        answered.set()
        wait_for(lambda: probe.answered_at is not None, 10, "an answer")
        probe.want(set())
        settled = len(asked)
        time.sleep(0.6)  # nothing to wait for: that no probe comes is the point
        assert len(asked) <= settled + 1  # at most the one in flight
    finally:
        probe.close()


# ---- a link that flaps, driven by hand (the shell's rule on a real job core, a fake clock) ----


class _Probe:
    """What the probe found, set by the test: a host answered at ``answered_at``, or not."""

    def __init__(self) -> None:
        self.answered_at: float | None = None
        self.unanswered_at: float | None = None

    def want(self, addresses: Any) -> None:
        pass

    def close(self) -> None:
        pass


class _Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.seen.append((kind, fields))


@dataclass
class _Slot:
    core: Any
    events: _Events
    finished_at: float | None = None


@pytest.mark.parametrize("embedded", [True, False], ids=["embedded", "standalone"])
def test_a_link_that_flaps_for_30_s_loses_no_healthy_node(embedded: bool) -> None:
    """Acceptance 22A F1/F2: the coordinator's link cut 2 s, up 1 s, for 30 s. In each up window
    a probe's connect gets through, but the nodes' own connections have backed off (they are
    heard only 5 s after the flapping ends). A deferred loss ended inside the next spell and
    cascaded (F1); a deferral sized by the last spell (3 s) ended before the nodes' backed-off
    retransmits (F2). No node is lost; one really dead is lost within the cap."""
    from test_coord_core import RESTART, ScriptedDecider, join, spec, started

    from unicron.coord.hearing import Hearing
    from unicron.coord.job import JobCore

    core = JobCore(spec(4, 4), ScriptedDecider(RESTART), now=0)
    for node in ("n0", "n1", "n2", "dead"):
        core.on_join(node, join(node, mn=4, mx=4), 0)
    started(core, 0)
    probe = _Probe()
    hearing = Hearing(lambda: 0.0, 1234, {"n0"} if embedded else set(), probe)  # type: ignore[arg-type]
    slots = {"job": _Slot(core, _Events())}
    lost: list[tuple[float, str]] = []

    def turn(t: float, heard: tuple[str, ...]) -> None:
        for node in heard:
            core.on_heartbeat(node, {"workers": [], "health": {}}, t)
            hearing.message(node, f"10.0.0.{node[-1]}", t, slots, "job")
        hearing.turn(t, slots)
        lost.extend((t, o.fields["node_id"]) for o in core.tick(t) if isinstance(o, Emit) and o.kind == "node_lost")

    t = 0.0
    while t < 10:  # all heard; "dead" dies at 10
        turn(t, ("n0", "n1", "n2", "dead"))
        t = round(t + 0.25, 2)
    own = ("n0",) if embedded else ()
    while t < 40:
        up = (t - 10) % 3 >= 2
        if up and probe.answered_at is None or up and probe.answered_at < t - 1:
            probe.answered_at = t  # a fresh connect in the up window: refused, so the network works
        elif not up:
            probe.unanswered_at = t
        turn(t, own)
        t = round(t + 0.25, 2)
    while t < 80 and not lost:  # the link is back; the nodes' connections retransmit at 45
        turn(t, ("n0", "n1", "n2") if t >= 45 else own)
        t = round(t + 0.25, 2)
    assert [node for _, node in lost] == ["dead"], lost
    assert lost[0][0] <= 10 + 60 + 3 + 0.5  # the cap from its last word, and the timeout
