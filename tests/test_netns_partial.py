"""Three hosts in network namespaces, each pair on a link of its own.

- The link between the two hosts that do not run the coordinator is cut (packets dropped
  silently). Both still reach the coordinator, so no node is lost: the job must see that one
  node cannot reach another, and go on without it (``--nnodes 2:3``) rather than restart until
  its budget is spent.
- The coordinator's own host is cut off from both others for a few seconds: its coordinator
  hears only its own node, and must take that for its own link's fault, not declare the two
  healthy nodes lost (``unicron.coord.hearing``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from e2e import clean_env, read_events, unicron_cmd, wait_for
from test_netns import _free_port_in, _ip, _reap
from test_run_exclude import SCRIPT  # trains 5 steps; rank 0 writes the world size it ended with

pytestmark = [pytest.mark.slow, pytest.mark.netns, pytest.mark.timeout(240)]


@pytest.fixture
def three_hosts() -> Iterator[dict[str, Any]]:
    """Hosts a (the coordinator's), b and c. Each has one address gloo uses, on its own link
    ("ab" for a and b, "ac" for c); host routes carry b <-> c over the "bc" link."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = f"up{os.getpid() % 100000}"
    ns = {h: f"{tag}{h}" for h in "abc"}
    o = os.getpid() % 250 + 1
    try:
        _ip("netns", "add", ns["a"])
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot create network namespaces here: {err.stderr.strip()}")
    try:
        for h in "bc":
            _ip("netns", "add", ns[h])
        links = {"ab": (f"10.214.{o}.1", f"10.214.{o}.2"), "ac": (f"10.215.{o}.1", f"10.215.{o}.2"),
                 "bc": (f"10.216.{o}.1", f"10.216.{o}.2")}
        for pair, (first, second) in links.items():
            x, y = pair
            _ip("link", "add", f"{tag}{pair}{x}", "type", "veth", "peer", "name", f"{tag}{pair}{y}")
            for host, addr in ((x, first), (y, second)):
                dev = f"{tag}{pair}{host}"
                _ip("link", "set", dev, "netns", ns[host])
                _ip("-n", ns[host], "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns[host], "link", "set", dev, "up")
        for h in "abc":
            _ip("-n", ns[h], "link", "set", "lo", "up")
        addr = {"a": links["ab"][0], "b": links["ab"][1], "c": links["ac"][1]}
        # c reaches a's address over its own link to a, and b's over the b-c link; b reaches c's
        _ip("-n", ns["c"], "route", "add", f"{addr['a']}/32", "dev", f"{tag}acc")
        _ip("-n", ns["c"], "route", "add", f"{addr['b']}/32", "via", links["bc"][0], "dev", f"{tag}bcc")
        _ip("-n", ns["b"], "route", "add", f"{addr['c']}/32", "via", links["bc"][1], "dev", f"{tag}bcb")
        ifname = {"a": f"{tag}aba", "b": f"{tag}abb", "c": f"{tag}acc"}

        def cut_b_from_c() -> None:
            """Route b <-> c through neighbours that do not exist: every packet is dropped."""
            _ip("-n", ns["b"], "route", "replace", f"{addr['c']}/32", "via", f"10.216.{o}.99", "dev", f"{tag}bcb")
            _ip("-n", ns["c"], "route", "replace", f"{addr['b']}/32", "via", f"10.216.{o}.98", "dev", f"{tag}bcc")

        def cut_a(cut: bool) -> None:
            """Cut a off from b and c both ways (neighbours that do not exist), or restore it."""
            for host, other, net in (("b", "a", "214"), ("a", "b", "214"), ("c", "a", "215"), ("a", "c", "215")):
                dev = f"{tag}{'ab' if net == '214' else 'ac'}{host}"
                how = ["via", f"10.{net}.{o}.{97 if host == 'a' else 99}"] if cut else []
                if cut or host == "c":  # c's route to a is a host route of its own; the others come back
                    _ip("-n", ns[host], "route", "replace", f"{addr[other]}/32", *how, "dev", dev)
                else:
                    _ip("-n", ns[host], "route", "del", f"{addr[other]}/32")

        yield {"ns": ns, "addr": addr, "ifname": ifname, "cut": cut_b_from_c, "cut_a": cut_a}
    finally:
        for name in ns.values():
            for pid in _ip("netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", name, check=False)




def test_a_node_cut_off_from_another_is_left_out_and_the_job_goes_on(three_hosts, workdir) -> None:
    (workdir / "partial.py").write_text(SCRIPT)
    h = three_hosts
    h["cut"]()  # before the start: b and c never meet
    endpoint = f"{h['addr']['a']}:{_free_port_in(h['ns']['a'])}"
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for host in "abc":
            cmd = ["ip", "netns", "exec", h["ns"][host], *unicron_cmd(
                "run", "--nnodes", "2:3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "partial",
                "--local-addr", h["addr"][host], "--rdzv-conf", "last_call_timeout=3", "--max-restarts", "4",
                "--grace-period", "2", "--log-dir", str(workdir / f"logs_{host}"), str(workdir / "partial.py"),
                str(workdir / "world.txt"))]
            env = clean_env(UNICRON_SECRET="netns-secret", GLOO_SOCKET_IFNAME=h["ifname"][host])
            procs[host] = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                           text=True)
            if host == "a":  # the coordinator's host, never left out
                wait = ["ip", "netns", "exec", h["ns"]["a"], "python3", "-c",
                        "import socket,sys,time\nfor _ in range(600):\n"
                        f" s=socket.socket()\n if s.connect_ex(('{h['addr']['a']}',{endpoint.rsplit(':', 1)[1]}))==0: sys.exit(0)\n"
                        " time.sleep(0.1)\nsys.exit(1)"]
                assert subprocess.run(wait, timeout=90).returncode == 0, "the coordinator did not listen"
        results = {host: (proc.wait(200), *proc.communicate()) for host, proc in procs.items()}
    finally:
        _reap(*procs.values())
    assert results["a"][0] == 0, results["a"][2]
    left_out = [host for host in "bc" if results[host][0] == 4 and "left out of job partial" in results[host][2]]
    assert len(left_out) == 1, (results["b"][2], results["c"][2])
    stayed = "bc".replace(left_out[0], "")
    assert results[stayed][0] == 0, results[stayed][2]
    assert (workdir / "world.txt").read_text() == "2"
    events = read_events(workdir / "logs_a")
    assert [e["action"] for e in events if e["kind"] == "decision"][-1] == "reconfigure"
    assert [e["world_size"] for e in events if e["kind"] == "attempt_start"][-1] == 2


def test_the_coordinators_host_cut_off_for_seconds_costs_no_node_and_no_restart(three_hosts, workdir) -> None:
    """The coordinator is embedded in host a's launcher, whose link is cut for longer than the
    heartbeat timeout (a's NIC, its switch port). a still hears its own agent, and nothing from
    b or c, whose hosts answer no connect: it takes the silence for its own, and the job trains
    on once the link is back, as under torchrun, with no node lost and no restart."""
    h = three_hosts
    endpoint = f"{h['addr']['a']}:{_free_port_in(h['ns']['a'])}"
    procs: dict[str, subprocess.Popen[str]] = {}
    logs = workdir / "logs_a"
    try:
        for host in "abc":
            cmd = ["ip", "netns", "exec", h["ns"][host], *unicron_cmd(
                "run", "--nnodes", "3", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "cut",
                "--local-addr", h["addr"][host], "--max-restarts", "2", "--grace-period", "2",
                "--log-dir", str(workdir / f"logs_{host}"), str(workdir / "train_state.py"), "--no-state",
                "--steps", "250", "--sleep", "0.05", "--out", str(workdir / "out.txt"))]
            env = clean_env(UNICRON_SECRET="netns-secret", GLOO_SOCKET_IFNAME=h["ifname"][host])
            procs[host] = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)
        wait_for(lambda: (workdir / "out.txt.startup").exists(), 120, "the first step")  # rank 0 writes it then
        h["cut_a"](True)
        try:
            wait_for(lambda: [e for e in read_events(logs) if e["kind"] in ("coordinator_deaf", "node_lost")],
                     30, "the coordinator to judge the silence")
            time.sleep(3)  # the cut lasts: past the heartbeat timeout (3 s) in all
        finally:
            h["cut_a"](False)
        results = {host: (proc.wait(150), *proc.communicate()) for host, proc in procs.items()}
    finally:
        _reap(*procs.values())
    for host in "abc":
        assert results[host][0] == 0, (host, results[host][2])
    events = read_events(logs)
    kinds = [e["kind"] for e in events]
    assert "node_lost" not in kinds and kinds.count("attempt_start") == 1, results["a"][2]
    deaf = next(e for e in events if e["kind"] == "coordinator_deaf")
    assert deaf["nodes"] == 2 and len(deaf["own_nodes"]) == 1
    assert [e for e in events if e["kind"] == "coordinator_hears_again"][0]["excused_s"] > 0
    assert "taking the silence for this coordinator's own" in results["a"][2]
