"""Who hosts the embedded coordinator when agents on one machine share the rendezvous port."""

from __future__ import annotations

import socket
from pathlib import Path

from unicron.agent import main as agent_main
from unicron.events import EventLog
from unicron.launch import parse_run_args
from unicron.launch.bridge import settings_from_config


def settings(tmp_path: Path, port: int):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cfg = parse_run_args(["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", str(script)],
                         {"UNICRON_SECRET": "s" * 32})
    return settings_from_config(cfg)


def held_port(*, listen: bool) -> socket.socket:
    """A socket on a free port, listening or not. Without SO_REUSEADDR, a bound socket blocks
    libzmq's bind as a twin agent's does for the instant they both try to listen."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if listen:
        sock.listen()
    return sock


def host(tmp_path: Path, port: int):
    events = EventLog(tmp_path / "events.jsonl", job="j")
    try:
        return agent_main._coordinator(settings(tmp_path, port), events, lambda _msg: None)
    finally:
        events.close()


def test_a_listener_on_the_port_means_another_agent_hosts(tmp_path) -> None:
    with held_port(listen=True) as sock:
        port = sock.getsockname()[1]
        server, endpoint = host(tmp_path, port)
    assert server is None and endpoint == f"tcp://127.0.0.1:{port}"


def test_a_port_taken_by_no_listener_is_tried_again_and_hosted(tmp_path, monkeypatch) -> None:
    # Two agents started at one instant can both fail listen() (both bound with SO_REUSEADDR);
    # the port is then free a moment later. Here the holder lets go when the agent looks for
    # a listener, and the agent must take the port on its next try rather than join nobody.
    holder = held_port(listen=False)
    port = holder.getsockname()[1]
    looked: list[bool] = []
    real = agent_main._listening

    def let_go_then_look(h: str, p: int) -> bool:
        holder.close()
        looked.append(real(h, p))
        return looked[-1]

    monkeypatch.setattr(agent_main, "_listening", let_go_then_look)
    server, endpoint = host(tmp_path, port)
    assert looked == [False]
    assert server is not None and server.port == port and endpoint == f"tcp://127.0.0.1:{port}"
    server.start()
    server.stop()


def test_a_port_held_by_no_listener_for_good_is_joined_after_a_while(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(agent_main, "_HOST_RACE_S", 0.2)
    with held_port(listen=False) as sock:
        port = sock.getsockname()[1]
        server, endpoint = host(tmp_path, port)
    assert server is None and endpoint == f"tcp://127.0.0.1:{port}"


def test_a_rendezvous_host_that_does_not_resolve_is_named() -> None:
    assert agent_main._unresolved("tcp://nosuchhost.invalid:5") == "nosuchhost.invalid"  # RFC 6761: never resolves
    assert agent_main._unresolved("tcp://localhost:5") is None
    assert agent_main._unresolved("tcp://127.0.0.1:5") is None
    assert agent_main._unresolved("tcp://[::1]:5") is None
    assert agent_main._unresolved("tcp://[fe80::1%eth0]:5") is None


def test_a_typo_in_the_rendezvous_host_is_said_at_once_not_only_as_silence(tmp_path) -> None:
    from e2e import clean_env, run_unicron

    script = tmp_path / "train.py"
    script.write_text("pass\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run_unicron(["run", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                f"nosuchhost.invalid:{port}", "--rdzv-conf", "join_timeout=2", str(script)],
                               tmp_path, timeout=60, env=clean_env(UNICRON_SECRET="s" * 32))
    assert code == 4, err
    assert "the rendezvous host nosuchhost.invalid does not resolve (yet)" in err, err
