"""Two agents in separate network namespaces (real network separation over a veth pair):
they form one job, and a partition leaves exactly one job going forward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e import clean_env, read_events, unicron_cmd, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str, str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = f"uc{os.getpid() % 100000}"
    ns_a, ns_b = f"{tag}a", f"{tag}b"
    octet = os.getpid() % 250 + 1
    addr_a, addr_b = f"10.213.{octet}.1", f"10.213.{octet}.2"
    try:
        _ip("netns", "add", ns_a)
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot create network namespaces here: {err.stderr.strip()}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        _ip("link", "set", f"{tag}va", "netns", ns_a)
        _ip("link", "set", f"{tag}vb", "netns", ns_b)
        for ns, dev, addr in ((ns_a, f"{tag}va", addr_a), (ns_b, f"{tag}vb", addr_b)):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, addr_a, addr_b
    finally:
        for ns in (ns_a, ns_b):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)


def _free_port_in(ns: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                          "import socket; s=socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[1])"],
                         capture_output=True, text=True, check=True, timeout=20).stdout
    return int(out)


def _agent(ns: str, addr: str, endpoint: str, workdir, nnodes: str, steps: int, logs: str,
           *script_args: str, join_timeout: int = 600, state: bool = False) -> subprocess.Popen[str]:
    cmd = ["ip", "netns", "exec", ns, *unicron_cmd(
        "run", "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "nsjob",
        "--local-addr", addr, "--rdzv-conf", f"last_call_timeout=1,join_timeout={join_timeout}",
        "--max-restarts", "2", "--grace-period", "2",
        "--log-dir", str(workdir / logs), str(workdir / "train_state.py"), *([] if state else ["--no-state"]),
        "--steps", str(steps), "--sleep", "0.05", "--out", str(workdir / "out.txt"), *script_args)]
    # As with torchrun, gloo must be told which interface reaches the other hosts.
    env = clean_env(UNICRON_SECRET="netns-secret", GLOO_SOCKET_IFNAME=f"{ns[:-1]}v{ns[-1]}")
    return subprocess.Popen(cmd, cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps(ns: str, endpoint: str) -> list[int]:
    """Each rank's step, as ``unicron status`` shows it from inside ``ns`` (empty until it answers)."""
    proc = subprocess.run(["ip", "netns", "exec", ns, *unicron_cmd("status", "--endpoint", endpoint, "--job", "nsjob",
                                                                     "--json")],
                          env=clean_env(UNICRON_SECRET="netns-secret"), capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        return []
    return [w.get("step") or 0 for n in json.loads(proc.stdout)["nodes"] for w in n["workers"]]


def _partition_until(ns: str, link: str, done: Any, timeout: float, what: str) -> None:
    """Take ``ns``'s link down until ``done()``, then up again (whatever happens meanwhile)."""
    _ip("-n", ns, "link", "set", link, "down")
    try:
        wait_for(done, timeout, what)
    finally:
        _ip("-n", ns, "link", "set", link, "up")


def _both_succeed(a: subprocess.Popen[str], b: subprocess.Popen[str], timeout: float) -> str:
    """Wait for both nodes to exit 0; returns b's stderr."""
    _, err_a = a.communicate(timeout=timeout)
    _, err_b = b.communicate(timeout=30)
    assert a.returncode == 0, err_a
    assert b.returncode == 0, err_b
    return err_b


def _reap(*procs: subprocess.Popen[str]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.communicate()


def test_agents_in_two_namespaces_form_one_job(two_hosts, workdir) -> None:
    ns_a, ns_b, addr_a, addr_b = two_hosts
    endpoint = f"{addr_a}:{_free_port_in(ns_a)}"
    a = _agent(ns_a, addr_a, endpoint, workdir, "2", 5, "logs_a")
    b = _agent(ns_b, addr_b, endpoint, workdir, "2", 5, "logs_b")
    try:
        out_a, err_a = a.communicate(timeout=120)
        out_b, err_b = b.communicate(timeout=60)
        assert a.returncode == 0, err_a
        assert b.returncode == 0, err_b
        starts = [e for e in read_events(workdir / "logs_a") if e["kind"] == "attempt_start"]
        assert starts[0]["world_size"] == 2 and starts[0]["nnodes"] == 2
        joins = {e["host"] for e in read_events(workdir / "logs_a") if e["kind"] == "join"}
        assert joins == {addr_a, addr_b}
    finally:
        _reap(a, b)


def test_a_slow_link_is_not_a_hang(two_hosts, workdir) -> None:
    """Once the job trains at its fast pace, the link between the nodes drops to 3 Mbit/s both
    ways (a shallow queue): each step's 1 MB all_reduce then takes about 3 s, twice the idle
    threshold the fast steps set (1.5 s). A rank's write lands in its socket's send buffer at
    once and drains for seconds with no other counter moving: only the send queue's draining
    shows the collective at work (acceptance 18C F4: such a job was called hung). Ten seconds
    of it cost no fault and no restart."""
    ns_a, ns_b, addr_a, addr_b = two_hosts
    if shutil.which("tc") is None:
        pytest.skip("needs tc (iproute2) to shape a link")
    endpoint = f"{addr_a}:{_free_port_in(ns_a)}"
    a = _agent(ns_a, addr_a, endpoint, workdir, "2", 100000, "logs_a", "--payload", "250000")
    b = _agent(ns_b, addr_b, endpoint, workdir, "2", 100000, "logs_b", "--payload", "250000")
    logs = workdir / "logs_a"
    try:
        wait_for(lambda: min(_steps(ns_a, endpoint), default=0) >= 20, 120, "20 fast steps on every rank")
        for ns in (ns_a, ns_b):
            shaped = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", f"{ns[:-1]}v{ns[-1]}",
                                     "root", "tbf", "rate", "3mbit", "burst", "32kbit", "latency", "100ms"],
                                    capture_output=True, text=True, timeout=20)
            if shaped.returncode != 0:
                pytest.skip(f"cannot shape a link here (tbf): {shaped.stderr.strip()}")
        slow_until = time.monotonic() + 10
        while time.monotonic() < slow_until:
            assert a.poll() is None and b.poll() is None, "the job ended on a slow link"
            faults = [e for e in read_events(logs) if e["kind"] in ("fault", "decision")]
            assert not faults, faults
            time.sleep(0.5)
        assert len([e for e in read_events(logs) if e["kind"] == "attempt_start"]) == 1
    finally:
        _reap(a, b)


def test_partition_leaves_one_job_going_forward(two_hosts, workdir) -> None:
    ns_a, ns_b, addr_a, addr_b = two_hosts
    endpoint = f"{addr_a}:{_free_port_in(ns_a)}"
    a = _agent(ns_a, addr_a, endpoint, workdir, "1:2", 100000, "logs_a")
    b = _agent(ns_b, addr_b, endpoint, workdir, "1:2", 100000, "logs_b", join_timeout=10)
    logs = workdir / "logs_a"
    try:
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start" and e["nnodes"] == 2],
                 90, "a 2-node attempt")
        cut_at = time.time()
        _ip("-n", ns_b, "link", "set", f"{ns_b[:-1]}vb", "down")  # the partition
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "node_lost"], 30, "node b declared lost")
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start"
                          and e["ts"] > cut_at and e["nnodes"] == 1], 60, "the job to go on with node a alone")
        # The cut-off node must stop its workers on its own: it cannot see the coordinator, so it
        # cannot go on. Its connection is not closed by a partition (no peer kernel says so), but
        # a's host does not accept a connection either: 15 s of silence, not the 4 x 15 s of a
        # stopped process. It then tries to join again up to the join timeout (here 10 s), since
        # the other side may wait for it (27B F1), and ends when that passes.
        wait_for(lambda: [e for e in read_events(workdir / "logs_b") if e["kind"] == "workers_stopped"
                          and e["reason"].startswith("cut off: ")], 45, "node b to stop its worker")
        b.wait(30)
        _, err_b = b.communicate()
        assert b.returncode != 0
        assert "lost the coordinator" in err_b and "no answer for 15 s" in err_b, err_b
        assert "host unreachable" in err_b, err_b
        assert "stopping this node's workers, keeping their snapshots, and joining again for up to 10 s" in err_b, err_b
        assert "and it did not answer again within 10 s" in err_b, err_b
        assert a.poll() is None  # the job goes on, once, on node a
    finally:
        _reap(a, b)


def test_a_healed_partition_lets_the_cut_off_node_join_again(two_hosts, workdir) -> None:
    """A fixed-size job: node b is cut off for longer than the heartbeat timeout, then the link
    comes back. The coordinator declared b lost and waits for a second node; b, fenced when its
    heartbeats get through again, stops its workers and joins again, and the job finishes."""
    ns_a, ns_b, addr_a, addr_b = two_hosts
    endpoint = f"{addr_a}:{_free_port_in(ns_a)}"
    a = _agent(ns_a, addr_a, endpoint, workdir, "2", 150, "logs_a")
    b = _agent(ns_b, addr_b, endpoint, workdir, "2", 150, "logs_b")
    logs = workdir / "logs_a"
    link = f"{ns_b[:-1]}vb"
    try:
        wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start"], 90, "the attempt")
        wait_for(lambda: [e for e in read_events(workdir / "logs_b") if e["kind"] == "workers_started"], 60,
                 "node b's worker")
        _partition_until(ns_b, link, lambda: [e for e in read_events(logs) if e["kind"] == "node_lost"], 30,
                         "node b declared lost")
        err_b = _both_succeed(a, b, 90)
        assert "fenced by the coordinator" in err_b, err_b
        starts = [e for e in read_events(logs) if e["kind"] == "attempt_start"]
        assert [s["nnodes"] for s in starts] == [2, 2]
        assert [e["rejoin_attempt"] for e in read_events(logs) if e["kind"] == "join" and "rejoin_attempt" in e] == [0]
    finally:
        _reap(a, b)


def test_a_partition_that_outlasts_the_nodes_patience_heals_from_memory(two_hosts, workdir) -> None:
    """Acceptance 27B F1: a fixed-size job, node b cut off for longer than the 15 s after which
    a node gives its coordinator up. b exited (4), its snapshots gone, while the coordinator
    waited for it to join again; started by hand, the job went back to its first step. Now b
    stops its workers, keeps their snapshots and joins again when the link is back: the job
    re-forms and restores from memory."""
    ns_a, ns_b, addr_a, addr_b = two_hosts
    endpoint = f"{addr_a}:{_free_port_in(ns_a)}"
    a = _agent(ns_a, addr_a, endpoint, workdir, "2", 400, "logs_a", state=True)
    b = _agent(ns_b, addr_b, endpoint, workdir, "2", 400, "logs_b", state=True)
    logs = workdir / "logs_a"
    link = f"{ns_b[:-1]}vb"
    try:
        wait_for(lambda: [e for e in read_events(workdir / "logs_b") if e["kind"] == "workers_started"], 90,
                 "node b's worker")
        wait_for(lambda: min(_steps(ns_a, endpoint) or [0]) >= 5, 60, "a few steps")
        _partition_until(ns_b, link, lambda: [e for e in read_events(workdir / "logs_b")
                                               if e["kind"] == "fenced" and e.get("cut_off")],
                         45, "node b to give the coordinator up")
        err_b = _both_succeed(a, b, 120)
        assert "joined the job again; it re-forms with this node" in err_b, err_b
        starts = [e for e in read_events(logs) if e["kind"] == "attempt_start"]
        assert [s["nnodes"] for s in starts] == [2, 2] and starts[1]["restore_step"] >= 5, starts
    finally:
        _reap(a, b)
