"""Several agents form one job: on loopback, elastically, losing a node, with a bad secret,
and stopped by signals with nothing left behind."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import pytest
import zmq
from e2e import clean_env, read_events, run_unicron, wait_for
from test_run_failing import FINALLY_DESTROY
from test_run_stepless import TRAINED_THEN, UNEVEN_END

from unicron.proto.client import request

pytestmark = pytest.mark.slow

SECRET = "s3cret-for-tests"


def _wait_for_output(workdir, text: str, count: int) -> None:
    def seen() -> bool:
        logs = list((workdir / "logs").rglob("stdout.log"))
        return sum(text in p.read_text(errors="replace") for p in logs) >= count

    wait_for(seen, 90, f"{count} workers to print {text!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pair(workdir, launch, script: str, text: str, job: str, *extra: str) -> list:
    """Two one-worker nodes on loopback running ``text`` (saved as ``script``), with ``extra`` flags."""
    (workdir / script).write_text(text)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--rdzv-id", job, *extra, "--log-dir", str(workdir / "logs"), str(workdir / script)]
    return [launch(args, workdir, clean_env(UNICRON_SECRET=SECRET)) for _ in range(2)]


def agent_args(workdir, port: int, nnodes: str, *extra: str, steps: int = 30, sleep: float = 0.05,
               rdzv_conf: str = "last_call_timeout=1") -> list[str]:
    return ["run", "--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "meshjob", "--rdzv-conf", rdzv_conf, "--max-restarts", "3", "--grace-period", "2",
            "--log-dir", str(workdir / "logs"), *extra, str(workdir / "train_state.py"), "--no-state",
            "--steps", str(steps), "--sleep", str(sleep), "--out", str(workdir / "out.txt")]


def test_two_agents_on_loopback_form_one_job(workdir, launch) -> None:
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", steps=5, sleep=0), workdir, env)
    b = launch(agent_args(workdir, port, "2", steps=5, sleep=0), workdir, env)
    for item in (a, b):
        code, out, err = item.wait(90)
        assert code == 0, err
    assert (workdir / "out.txt").exists()
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2 and starts[0]["nnodes"] == 2


def test_an_inject_given_on_one_node_fires_on_the_node_that_runs_its_rank(workdir, launch) -> None:
    """Acceptance 25C F3: ``--inject kill@1:5`` given on node 0 only, rank 1 on node 1: each
    agent applied its own flags, so it never fired, and nothing said so. A RANK is global."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", "--node-rank", "0", "--inject", "kill@1:5", steps=12), workdir, env)
    b = launch(agent_args(workdir, port, "2", "--node-rank", "1", steps=12), workdir, env)
    results = [item.wait(120) for item in (a, b)]
    assert [code for code, _, _ in results] == [0, 0], results
    assert "exit on rank 1 at step 5: signal SIGKILL" in results[1][2], results[1][2]
    faults = [e for e in read_events(workdir / "logs") if e["kind"] == "fault"]
    assert {(e["rank"], e.get("signal")) for e in faults} == {(1, "SIGKILL")}, faults


ROLE_DUMP = """
import json, os, sys
keys = ("RANK", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE")
with open(os.path.join(sys.argv[1], f"env.{os.environ['RANK']}.json"), "w") as fh:
    json.dump({k: os.environ[k] for k in keys}, fh)
"""


def test_role_ranks_count_within_each_nodes_role_as_torchrun_does(workdir, launch) -> None:
    """Acceptance 25B F1: with --role trainer on node 0 and evaler on node 1 (2 workers each),
    torchrun gives the evalers ROLE_RANK 0, 1 and ROLE_WORLD_SIZE 2; unicron gave 2, 3 and 4."""
    (workdir / "roles.py").write_text(ROLE_DUMP)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    nodes = [launch(["run", "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(rank), "--role", role,
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "roles", "--log-dir",
                     str(workdir / f"logs{rank}"), str(workdir / "roles.py"), str(workdir)], workdir, env)
             for rank, role in ((0, "trainer"), (1, "evaler"))]
    for node in nodes:
        code, _, err = node.wait(90)
        assert code == 0, err
    seen = {r: json.loads((workdir / f"env.{r}.json").read_text()) for r in range(4)}
    assert [(e["ROLE_NAME"], e["ROLE_RANK"], e["ROLE_WORLD_SIZE"]) for e in seen.values()] == [
        ("trainer", "0", "2"), ("trainer", "1", "2"), ("evaler", "0", "2"), ("evaler", "1", "2")], seen


def test_a_node_whose_clock_is_200_s_ahead_joins_and_the_job_runs(workdir, launch) -> None:
    # Messages carry wall-clock time against replays; a node whose clock is off by more than
    # the window (no NTP, a VM resumed from a suspend) had all its messages dropped and waited
    # out the join timeout, blaming the secret. torchrun does not care: nor does unicron now.
    skew = workdir / "skew"
    skew.mkdir()
    (skew / "sitecustomize.py").write_text("import time\n_real = time.time\ntime.time = lambda: _real() + 200\n")
    port = free_port()
    a = launch(agent_args(workdir, port, "2", steps=5, sleep=0, rdzv_conf="last_call_timeout=1,join_timeout=60"),
               workdir, clean_env(UNICRON_SECRET=SECRET))
    wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 60, "a's coordinator to listen")
    b = launch(agent_args(workdir, port, "2", steps=5, sleep=0, rdzv_conf="last_call_timeout=1,join_timeout=60"),
               workdir, clean_env(UNICRON_SECRET=SECRET, PYTHONPATH=str(skew)))
    results = {name: item.wait(90) for name, item in (("a", a), ("b", b))}
    for code, _out, err in results.values():
        assert code == 0, err
    assert (workdir / "out.txt").exists()
    told = [line for line in results["b"][2].splitlines() if "clock is" in line]
    assert len(told) == 1 and "200 s ahead of the coordinator's" in told[0] and "NTP" in told[0], results["b"][2]
    assert "this node's clock is 200 s ahead" in results["a"][2]  # the coordinator's console names it too


def test_rdzv_conf_is_host_picks_the_node_that_hosts_the_coordinator(workdir, launch) -> None:
    """torchrun's is_host: the node started first with is_host=0 joins, and waits, rather than
    binding the endpoint as the first to come otherwise would; the one with is_host=1 hosts."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    guest = launch(agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="last_call_timeout=1,is_host=0"),
                   workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "agent_start"], 60,
             "the guest agent to start")
    assert socket.socket().connect_ex(("127.0.0.1", port)) != 0  # nobody listens: it did not host
    host = launch(agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="last_call_timeout=1,is_host=1"),
                  workdir, env)
    results = {name: item.wait(90) for name, item in (("guest", guest), ("host", host))}
    for code, _out, err in results.values():
        assert code == 0, err
    assert "coordinator for job" in results["host"][2] and "coordinator for job" not in results["guest"][2]


def ipv6_loopback_port() -> int:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            return int(s.getsockname()[1])
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")


def test_two_agents_meet_at_an_ipv6_endpoint_and_a_static_ipv6_master(workdir, launch) -> None:
    port = ipv6_loopback_port()  # free on ::1; the coordinator listens on both stacks
    env = clean_env(UNICRON_SECRET=SECRET)
    args = [a if a != f"127.0.0.1:{port}" else f"[::1]:{port}" for a in agent_args(workdir, port, "2", steps=3, sleep=0)]
    agents = [launch(args, workdir, env) for _ in range(2)]
    for item in agents:
        code, out, err = item.wait(90)
        assert code == 0, err
    starts = [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"]
    assert len(starts) == 1 and starts[0]["world_size"] == 2
    # torchrun's static rendezvous with a bare IPv6 --master-addr (no brackets)
    static = ["run", "--rdzv-backend", "static", "--master-addr", "::1", "--master-port", str(ipv6_loopback_port()),
              "--nproc-per-node", "1", "--log-dir", str(workdir / "logs2"), str(workdir / "train_state.py"),
              "--no-state", "--steps", "2", "--sleep", "0", "--out", str(workdir / "out2.txt")]
    code, out, err = launch(static, workdir, clean_env()).wait(90)
    assert code == 0, err
    assert (workdir / "out2.txt").exists()


def test_a_crashed_nodes_replacement_that_asks_too_early_waits_for_its_place(workdir, launch) -> None:
    # A scheduler restarts a crashed node at once: its join arrives while the dead node still
    # counts (it is declared lost only after the heartbeat timeout). The job is full for now,
    # so the replacement keeps asking, gets the place, and the job finishes.
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    # With its state kept (no --no-state): the attempt after the loss goes on from memory
    # rather than training all 400 steps again.
    args = [x for x in agent_args(workdir, port, "2", "--redirects", "1", steps=400, sleep=0.05) if x != "--no-state"]
    a = launch(args, workdir, env)
    wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 60, "a's coordinator to listen")
    b = launch(args, workdir, env)
    _wait_for_output(workdir, "starts at step", 2)
    # The replacement asks first, then b crashes: its join surely arrives while b still counts
    # (started after the kill, a replacement slow to import on a busy machine may ask only after
    # b was declared lost, and never be turned away).
    replacement = launch(args, workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "join_refused"], 90,
             "the replacement to be turned away while b counts")
    b.proc.send_signal(signal.SIGKILL)  # its workers die with it (PDEATHSIG)
    b.proc.wait(10)
    for item in (a, replacement):
        code, out, err = item.wait(120)
        assert code == 0, err
    # The replacement (the last waited for) shows the decision that made its attempt as an old one.
    assert re.search(r"joining attempt \d+, decided before this node came: .*stopped answering", err), err
    assert (workdir / "out.txt").exists()
    events = read_events(workdir / "logs")
    refused = [e for e in events if e["kind"] == "join_refused"]
    assert refused and all(e["waits"] for e in refused) and "job is full" in refused[0]["reason"], refused
    lost = [e for e in events if e["kind"] == "node_lost"]
    assert lost and lost[0]["ts"] > refused[0]["ts"]  # asked before the loss, admitted after it


def test_working_rank_on_one_node_keeps_the_other_node_from_calling_a_hang(workdir, launch) -> None:
    # Rank 1 evaluates for 6 s while rank 0, on the other node, idles in a barrier: rank 0's
    # agent sees only idle ranks, and must hear from the coordinator that the job is working
    # before its idle threshold (1.5 s) runs out, and that it is working, not merely busy
    # (the busy threshold is 3 s here).
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    agents = [launch(agent_args(workdir, port, "2", "--first-step-timeout", "60", "--hang-busy-floor", "3",
                                steps=10, sleep=0.02) + ["--pause", "eval@1:4:6"], workdir, env) for _ in range(2)]
    for item in agents:
        code, out, err = item.wait(90)
        assert code == 0, err
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] == "fault"], [e for e in events if e["kind"] == "fault"]
    assert len([e for e in events if e["kind"] == "attempt_start"]) == 1


def test_elastic_late_joiner_is_admitted_and_lost_node_is_survived(workdir, launch) -> None:
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "1:2", steps=400), workdir, env)
    logs = workdir / "logs"
    wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start"], 60, "first attempt")
    b = launch(agent_args(workdir, port, "1:2", steps=400), workdir, env)
    grown = wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start" and e["nnodes"] == 2],
                     60, "the job to grow to 2 nodes")
    assert grown[0]["world_size"] == 2
    # Let it train a little, then make node b vanish without a word.
    wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "workers_started" and e.get("world_size") == 2],
             30, "workers on both nodes")
    killed_at = time.time()
    b.proc.send_signal(signal.SIGKILL)
    b.proc.wait(10)
    lost = wait_for(lambda: [e for e in read_events(logs) if e["kind"] in ("node_lost", "leave")], 30,
                    "the coordinator to notice the lost node")
    detect_s = lost[0]["ts"] - killed_at
    print(f"lost node detected after {detect_s:.2f}s ({lost[0]['kind']})")
    shrunk = wait_for(lambda: [e for e in read_events(logs) if e["kind"] == "attempt_start"
                               and e["ts"] > killed_at and e["nnodes"] == 1], 60, "the job to re-form on 1 node")
    assert shrunk[0]["world_size"] == 1
    a.kill()


@pytest.mark.parametrize("wrong", ["secret", "rdzv-id"])
def test_agent_with_wrong_secret_or_job_id_is_refused_clearly(workdir, launch, wrong: str) -> None:
    port = free_port()
    a = launch(agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="join_timeout=8"), workdir,
               clean_env(UNICRON_SECRET=SECRET))
    # a must be the one hosting the coordinator (whichever agent binds the port first hosts it).
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "agent_start" and e["coordinator"]],
             60, "agent a to host the coordinator")
    args_b = agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="join_timeout=8")
    if wrong == "rdzv-id":
        args_b[args_b.index("meshjob")] = "otherjob"
    b = launch(args_b, workdir, clean_env(UNICRON_SECRET="not-the-secret" if wrong == "secret" else SECRET))
    code_b, _, err_b = b.wait(60)
    code_a, _, err_a = a.wait(60)
    if wrong == "secret":  # no answer: it cannot be trusted with one
        assert code_b != 0 and "no coordinator answered" in err_b and "UNICRON_SECRET" in err_b
        assert "no answer yet from the coordinator" in err_b, err_b  # said before the join timeout ran out
    else:  # the right secret: told at once that the endpoint is another job's (acceptance 21B F1)
        assert code_b == 4 and "is job 'meshjob''s (embedded in its launcher), not job 'otherjob''s" in err_b, err_b
        assert "UNICRON_SECRET" not in err_b, err_b
    assert code_a != 0 and "rendezvous timed out" in err_a
    # The coordinator's node says why at once, not only when its join timeout runs out.
    said = "signed with another secret" if wrong == "secret" else "for job 'otherjob'"
    assert err_a.count(said) == 1, err_a
    assert wrong != "rdzv-id" or "is --rdzv-id the same on every node?" in err_a, err_a


def _two_ready_workers(workdir, launch, name: str, grace: str, setup: str):
    """A standalone 2-worker job of ``setup`` then an idle loop, with --grace-period ``grace``;
    returns once both workers printed 'ready'."""
    (workdir / name).write_text(setup + "print('ready', flush=True)\nwhile True:\n    time.sleep(0.1)\n")
    item = launch(["run", "--standalone", "--nproc-per-node", "2", "--grace-period", grace, "--redirects", "1",
                   "--log-dir", str(workdir / "logs"), str(workdir / name)], workdir)
    _wait_for_output(workdir, "ready", 2)
    return item


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_everything_and_leaves_no_orphans(workdir, launch, sig, code) -> None:
    # Both workers start a grandchild before they are ready.
    item = _two_ready_workers(workdir, launch, "spawner.py", "3", (
        "import subprocess, sys, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', sys.argv[0]])\n"))
    item.proc.send_signal(sig)
    rc, _, err = item.wait(30)
    assert rc == code, err
    assert "interrupted" in err
    # What the coordinator decides about the node that left is for the other nodes, not news here.
    assert "SEV1" not in err and "restart budget" not in err, err
    # Nor is it a node loss in the log: the job ended because its launcher was interrupted.
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("decision", "leave", "waiting_for_nodes")], events
    end = [e for e in events if e["kind"] == "job_end"]
    assert len(end) == 1 and end[0]["exit_code"] == code and "interrupted" in end[0]["reason"], end
    assert end[0]["restarts"] == 0, end


def test_an_interrupt_whose_workers_take_longer_to_stop_than_the_heartbeat_timeout_is_no_node_loss(
        workdir, launch) -> None:
    """The workers save a checkpoint for 4 s on SIGTERM (a preemption handler): the agent, busy
    stopping them, sends no heartbeat for longer than the 3 s timeout. Its own coordinator ends
    the job first, so the log records the interruption, not a lost node and a budget stop."""
    item = _two_ready_workers(workdir, launch, "saver.py", "20", (
        "import signal, sys, time, torch.distributed as dist\n"
        "def save(*_):\n    time.sleep(4)\n    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        "dist.init_process_group('gloo')\n"))
    item.proc.send_signal(signal.SIGTERM)
    rc, _, err = item.wait(60)
    assert rc == 143, err
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("node_lost", "decision", "stop")], events
    end = [e for e in events if e["kind"] == "job_end"]
    assert len(end) == 1 and end[0]["exit_code"] == 143 and "interrupted" in end[0]["reason"], end


def test_a_second_signal_cuts_the_grace_period_short(workdir, launch) -> None:
    """Workers that ignore SIGTERM get --grace-period (60 s here) before SIGKILL; a second
    signal to the launcher (Ctrl-C twice) kills them at once."""
    import psutil

    item = _two_ready_workers(workdir, launch, "stubborn.py", "60", (
        "import signal, time, torch.distributed as dist\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('ignoring SIGTERM', flush=True))\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "dist.init_process_group('gloo')\n"))
    workers = [c for c in psutil.Process(item.proc.pid).children(recursive=True) if "stubborn.py" in " ".join(c.cmdline())]
    assert len(workers) == 2, workers
    item.proc.send_signal(signal.SIGTERM)
    # The first signal is forwarded and ignored: the workers live on in the grace period.
    _wait_for_output(workdir, "ignoring SIGTERM", 2)
    assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    started = time.monotonic()
    item.proc.send_signal(signal.SIGINT)
    rc, _, err = item.wait(30)
    assert time.monotonic() - started < 20, "the second signal did not cut the grace period short"
    assert rc == 143, err
    stopped = [e for e in read_events(workdir / "logs") if e["kind"] == "workers_stopped"]
    assert stopped and stopped[-1]["killed_ranks"] == [0, 1], stopped


def test_workers_die_with_a_sigkilled_agent(workdir, launch) -> None:
    import psutil

    item = launch(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "logs"),
                   "--redirects", "1", str(workdir / "train_state.py"), "--no-state", "--steps", "100000",
                   "--sleep", "0.05"], workdir)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "workers_started"], 60, "workers")
    agent = psutil.Process(item.proc.pid)
    workers = wait_for(lambda: len(found := [c for c in agent.children(recursive=True)
                                             if "train_state.py" in " ".join(c.cmdline())]) == 2 and found
                       if agent.is_running() else None, 30, "the worker processes")
    _wait_for_output(workdir, "starts at step", 2)  # both workers run the script: their hooks are in
    shm = _owned_shm_dirs(item.proc.pid)
    assert len(shm) == 1, shm
    item.proc.send_signal(signal.SIGKILL)
    item.proc.wait(10)
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, f"workers outlived their agent: {[p.pid for p in alive]}"
    # Its janitor removes the snapshot directory the agent could not (it would hold RAM until
    # the next agent on the machine started).
    wait_for(lambda: not shm[0].exists(), 15, "the dead agent's shared memory to be removed")


def test_what_a_warm_worker_forks_without_exec_dies_with_a_sigkilled_agent(workdir, launch) -> None:
    """A warm worker is a fork of the agent's zygote: its /proc/PID/environ, and that of a child
    it forks without exec (multiprocessing's fork context), is the zygote's. The zygote carries
    the janitor's marker, so such a child goes with a SIGKILLed agent (it used to stay)."""
    import psutil

    (workdir / "forks.py").write_text("""
import multiprocessing, os, sys, time
import torch.distributed as dist

def linger(path):
    os.setsid()  # out of the worker's process group, as a daemon would be
    open(path, "w").write(str(os.getpid()))
    time.sleep(600)

dist.init_process_group("gloo")
child = multiprocessing.get_context("fork").Process(target=linger, args=(sys.argv[1] + str(dist.get_rank()),))
child.start()
while True:
    time.sleep(0.1)
""")
    item = launch(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "logs"),
                   str(workdir / "forks.py"), str(workdir / "child")], workdir)
    paths = [workdir / "child0", workdir / "child1"]
    wait_for(lambda: all(p.exists() and p.read_text() for p in paths), 60, "the forked children")
    started = [e for e in read_events(workdir / "logs") if e["kind"] == "workers_started"]
    assert started and started[0]["warm"] == 2, started  # forks of the zygote
    children = [psutil.Process(int(p.read_text())) for p in paths]
    item.proc.send_signal(signal.SIGKILL)
    item.proc.wait(10)
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"forked children outlived their agent: {[c.pid for c in alive]}"


def _owned_shm_dirs(pid: int) -> list:
    """The shared-memory directories whose owner mark names the agent with ``pid``."""
    from pathlib import Path

    found = []
    for owner in Path("/dev/shm").glob("unicron-*/agent.owner"):
        try:
            if owner.read_text().split()[0] == str(pid):
                found.append(owner.parent)
        except (OSError, IndexError):
            continue
    return found


def test_standalone_coordinator_serves_two_jobs(workdir, launch) -> None:
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    coord = launch(["coordinator", "--port", str(port), "--host", "127.0.0.1", "--log-dir", str(workdir / "coord")],
                   workdir, env)
    jobs = []
    for name in ("job-a", "job-b"):
        jobs.append(launch(["run", "--nnodes", "1", "--nproc-per-node", "2", "--coordinator", f"127.0.0.1:{port}",
                            "--rdzv-id", name, "--log-dir", str(workdir / name), str(workdir / "train_state.py"),
                            "--no-state", "--steps", "5", "--out", str(workdir / f"{name}.txt")], workdir, env))
    for item in jobs:
        code, _, err = item.wait(90)
        assert code == 0, err
    for name in ("job-a", "job-b"):
        events = read_events(workdir / "coord" / name)
        assert [e["exit_code"] for e in events if e["kind"] == "job_end"] == [0]
        assert {e["job"] for e in events} == {name}
    assert coord.proc.poll() is None  # it serves on after both jobs ended
    coord.proc.send_signal(signal.SIGTERM)
    code, _, err = coord.wait(20)
    assert code == 0, err



def test_losing_the_coordinators_node_stops_the_other_cleanly_without_a_false_hang(workdir, launch) -> None:
    """Node a (hosting the coordinator) is SIGKILLed: node b's rank fails on its lost peer, no
    decision can come, and b stops on its own once the coordinator is silent. Its failed rank is
    not called hung meanwhile (that verdict would be about a process already gone)."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", "--redirects", "1", steps=100000, sleep=0.05), workdir, env)
    wait_for(lambda: (workdir / "logs").exists() and any((workdir / "logs").glob("*/events.jsonl")), 60,
             "node a to host the coordinator")
    b = launch(agent_args(workdir, port, "2", "--redirects", "1", steps=100000, sleep=0.05), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"], 90, "the attempt")
    _wait_for_output(workdir, "starts at step", 2)
    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    code, out, err = b.wait(90)
    assert code != 0 and "lost the coordinator" in err, err
    assert "hang on node" not in err, err


def test_interrupting_the_coordinators_node_ends_the_other_at_once(workdir, launch) -> None:
    """Node a (hosting the coordinator) gets SIGTERM: it stops its workers and exits 143, and
    its coordinator ends the job for node b on its way out, so b stops with a's reason at once
    instead of waiting out the coordinator's silence ("lost the coordinator", 15 s later)."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", "--redirects", "1", steps=100000, sleep=0.05), workdir, env)
    wait_for(lambda: (workdir / "logs").exists() and any((workdir / "logs").glob("*/events.jsonl")), 60,
             "node a to host the coordinator")
    b = launch(agent_args(workdir, port, "2", "--redirects", "1", steps=100000, sleep=0.05), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"], 90, "the attempt")
    _wait_for_output(workdir, "starts at step", 2)
    a.proc.send_signal(signal.SIGTERM)
    code_a, _, err_a = a.wait(60)
    code_b, _, err_b = b.wait(60)
    assert code_a == 143, err_a
    assert code_b == 1 and "the coordinator's node stopped: interrupted by SIGTERM" in err_b, err_b
    assert "lost the coordinator" not in err_b, err_b


def _snapshot_steps_of(pid: int) -> list[int]:
    """Steps of which the agent with ``pid`` holds a complete snapshot in shared memory."""
    from pathlib import Path

    steps = []
    for owner in Path("/dev/shm").glob("unicron-meshjob-*/agent.owner"):
        try:
            if owner.read_text().split()[0] != str(pid):
                continue
        except (OSError, IndexError):
            continue
        steps += [int(p.name[4:-3]) for p in owner.parent.glob("rank*/step*.pt")]
    return steps


def _two_nodes(workdir, launch, args: list[str], *, snapshot_step: int) -> tuple:
    """Node a (hosting the coordinator, started first) and node b, both running ``args`` with
    ``unicron.State``; returns once b holds a snapshot of ``snapshot_step``."""
    env = clean_env(UNICRON_SECRET=SECRET)
    args = [a for a in args if a != "--no-state"]
    a = launch(args, workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "agent_start" and e["coordinator"]],
             60, "node a to host the coordinator")
    b = launch(args, workdir, env)
    wait_for(lambda: [s for s in _snapshot_steps_of(b.proc.pid) if s >= snapshot_step], 90,
             f"node b to snapshot step {snapshot_step}")
    return a, b


def _assert_untouched_job_finished(workdir, *nodes) -> None:
    """Every node exited 0 after one attempt, with no fault, loss or decision on the way."""
    for item in nodes:
        code, out, err = item.wait(90)
        assert code == 0, out + err
    events = read_events(workdir / "logs")
    trouble = [e for e in events if e["kind"] in ("fault", "node_lost", "decision")]
    assert not trouble, trouble
    assert len([e for e in events if e["kind"] == "attempt_start"]) == 1


def _stop_tree(pid: int, seconds: float) -> None:
    """SIGSTOP a launcher and every process under it (a VM pause), for ``seconds``."""
    import psutil

    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in tree:
        proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)  # the stall itself
    finally:
        for proc in tree:
            try:
                proc.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                pass


def test_a_node_stalled_past_the_heartbeat_timeout_rejoins_and_nothing_is_lost(workdir, launch) -> None:
    """Node b (not the coordinator's) stops whole, launcher and workers (a VM pause), for 16 s:
    longer than the heartbeat timeout (3 s) and than the coordinator's silence that would end an
    agent (15 s), which b must not count against the coordinator, since b was not running. The
    coordinator declares b lost and stops a; when b runs again it is fenced, stops its workers,
    joins again in its old place, and the job restores every rank from memory: the final model
    equals a failure-free run's."""
    from e2e import run_unicron

    steps = ["--steps", "50"]
    code, _, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "ref"),
                                str(workdir / "train_state.py"), *steps, "--out", str(workdir / "ref.txt")], workdir)
    assert code == 0, err
    a, b = _two_nodes(workdir, launch, agent_args(workdir, free_port(), "2", steps=50, sleep=0.1), snapshot_step=5)
    _stop_tree(b.proc.pid, 16)
    results = [item.wait(90) for item in (a, b)]
    for code, out, err in results:
        assert code == 0, out + err
    assert "fenced by the coordinator" in results[1][2], results[1][2]
    assert (workdir / "out.txt").read_text() == (workdir / "ref.txt").read_text()
    events = read_events(workdir / "logs")
    kinds = [e["kind"] for e in events]
    assert "node_lost" in kinds and "fenced" in kinds and "rejoined" in kinds, kinds
    starts = [e for e in events if e["kind"] == "attempt_start"]
    assert len(starts) == 2 and starts[1]["nnodes"] == 2
    assert starts[1]["restore_step"] is not None and starts[1]["restore_step"] >= 5, starts[1]


def test_a_node_stalled_briefly_costs_no_restart_and_no_blame(workdir, launch) -> None:
    """Node b, then node a (the coordinator's), stops whole for 2 s: longer than the idle hang
    threshold (1.5 s) of the other node's rank, which waits for the stopped one's in the
    all-reduce, shorter than the heartbeat timeout. The other node hears at once that the job
    is at least busy (the coordinator says b is silent; a's silence is the coordinator's own),
    and the stopped node is back before anyone is blamed: one attempt, no fault."""
    # A few steps in: the hang detector is past its warm-up allowance.
    a, b = _two_nodes(workdir, launch, agent_args(workdir, free_port(), "2", "--heartbeat-timeout", "5", steps=120,
                                                  sleep=0.1), snapshot_step=8)
    _stop_tree(b.proc.pid, 2.0)
    step = max(_snapshot_steps_of(b.proc.pid))
    wait_for(lambda: [s for s in _snapshot_steps_of(b.proc.pid) if s >= step + 10], 60, "ten more steps")
    _stop_tree(a.proc.pid, 2.0)
    _assert_untouched_job_finished(workdir, a, b)


def test_the_coordinators_launcher_stopped_for_long_leaves_the_job_training(workdir, launch) -> None:
    """Only the launcher of node a (hosting the coordinator) stops, for 16 s: longer than the
    silence that ends an agent (15 s). Node b's rank keeps stepping with a's, which shows the
    job alive: b does not stop its healthy worker, and the job finishes with one attempt."""
    # 200 steps of at least 0.1 s: at most 168 pass during the stall, so the job trains on after it.
    a, b = _two_nodes(workdir, launch, agent_args(workdir, free_port(), "2", steps=200, sleep=0.1), snapshot_step=8)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(16)  # the stall itself
    finally:
        a.proc.send_signal(signal.SIGCONT)
    _assert_untouched_job_finished(workdir, a, b)


def test_a_node_stalled_through_the_end_of_its_job_learns_how_it_ended(workdir, launch) -> None:
    """With no restarts allowed, losing stalled node b ends the job. b, running again, finds the
    coordinator's word in its socket and ends with the job's reason, at once: not 15 s later
    with "lost the coordinator"."""
    args = agent_args(workdir, free_port(), "2", steps=200, sleep=0.1)
    args[args.index("--max-restarts") + 1] = "0"
    a, b = _two_nodes(workdir, launch, args, snapshot_step=3)
    _stop_tree(b.proc.pid, 4.5)
    code_a, _, err_a = a.wait(60)
    code_b, _, err_b = b.wait(60)
    assert code_a == 1 and "restart budget spent" in err_a, err_a
    assert code_b == 1 and "restart budget spent" in err_b and "lost the coordinator" not in err_b, err_b


@pytest.mark.parametrize("steps", [25, 200])
def test_a_node_whose_workers_finished_while_the_coordinator_was_stopped_exits_0(workdir, launch, steps) -> None:
    """The launcher of node a (hosting the coordinator) stops until node b exits; meanwhile
    every rank finishes: within seconds (25 steps), or after training on for longer than the
    15 s of silence that end an agent (200 steps of 0.1 s: a rank that said bye must not take
    the job's last step with it). Node b did its part: 15 s after its last sign of life it
    exits 0 and says the job's end was not confirmed (torchrun's agent exits 0 when its exit
    barrier fails); a, running again, finishes the job."""
    a, b = _two_nodes(workdir, launch, agent_args(workdir, free_port(), "2", steps=steps, sleep=0.1),
                      snapshot_step=3)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        code_b, _, err_b = b.wait(90)
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert code_b == 0 and "did not confirm the job's end" in err_b, err_b
    code_a, _, err_a = a.wait(60)
    assert code_a == 0, err_a


# After the last step rank 3 exits 0, the others sit in their tail (a final checkpoint upload, wandb.finish()).
TAIL_AFTER_TRAINING = TRAINED_THEN.replace("TAIL", "if rank != 3:\n    time.sleep(5)")


def test_an_idle_tail_on_one_node_after_a_rank_of_another_finished_is_not_a_hang(workdir, launch) -> None:
    """Rank 3 (on one node) exits 0 after the last step; its node's other rank and the other
    node's ranks idle 5 s in their tails, past the 1.5 s idle threshold. The first node says so
    in its heartbeat, the coordinator tells every agent, and nobody calls a hang (it used to
    call one on the other node and restart the job until the budget was spent)."""
    (workdir / "tail.py").write_text(TAIL_AFTER_TRAINING)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "tailjob", "--max-restarts", "3", "--log-dir", str(workdir / "logs"), str(workdir / "tail.py")]
    nodes = [launch(args, workdir, env) for _ in range(2)]
    for node in nodes:
        code, out, err = node.wait(90)
        assert code == 0, err
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("fault", "decision", "hang_ignored")], events
    assert len([e for e in events if e["kind"] == "attempt_start"]) == 1



def test_a_rank_waiting_at_the_end_for_another_nodes_rank_that_trains_on_is_not_hung(workdir, launch) -> None:
    """The uneven end across nodes: the coordinator sees one rank two or more steps ahead of
    another and still stepping, and tells every agent that the job is working."""
    nodes = _pair(workdir, launch, "uneven_end.py", UNEVEN_END, "unevenjob", "--max-restarts", "0")
    for node in nodes:
        code, out, err = node.wait(90)
        assert code == 0, err
    events = read_events(workdir / "logs")
    assert not [e for e in events if e["kind"] in ("fault", "decision")], events


ONE_NODE_ENDS_FIRST = """
import os, sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
while (rank == 1 and step < 5) or (rank == 0 and not os.path.exists(sys.argv[1])):  # rank 0 has more data
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    step += 1
    time.sleep(0.05)
print(f"rank {rank} done after {step} steps", flush=True)
"""


def test_a_node_whose_workers_finished_may_be_interrupted_while_the_others_train_on(workdir, launch) -> None:
    """Acceptance 25A F2: SIGTERM to the launcher of a node whose ranks had all exited 0 (a
    Ctrl-C at its exit barrier) stopped the other node's training and left the job waiting the
    join timeout for it. Under torchrun the others train on to their end, as they do now."""
    (workdir / "ends_first.py").write_text(ONE_NODE_ENDS_FIRST)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)

    def node(rank: int):
        return launch(["run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "endsfirst", "--max-restarts", "1",
                       "--log-dir", str(workdir / f"logs{rank}"), str(workdir / "ends_first.py"),
                       str(workdir / "go")], workdir, env)

    a = node(0)  # the coordinator's host (an embedded coordinator ends with its launcher, as torchrun's store)
    wait_for(lambda: [e for e in read_events(workdir / "logs0") if e["kind"] == "agent_start" and e["coordinator"]],
             60, "node 0 to host the coordinator")
    b = node(1)
    wait_for(lambda: [e for e in read_events(workdir / "logs1") if e["kind"] == "workers_finished"], 90,
             "node 1's workers to finish")
    b.proc.send_signal(signal.SIGTERM)
    code, _, err = b.wait(30)
    assert code == 143, err
    (workdir / "go").touch()
    code, _, err = a.wait(60)
    assert code == 0, err
    events = read_events(workdir / "logs0")
    assert not [e for e in events if e["kind"] in ("decision", "stop", "attempt_stop")], events
    assert [e["kind"] for e in events if e["kind"] == "attempt_start"] == ["attempt_start"]


RAISES_WITH_A_SLOW_EXIT = """
import atexit, os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
for step in range(12):
    opt.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    time.sleep(0.05)
    if first and step == 6 and rank == 1:
        atexit.register(time.sleep, 4)  # a flush or an upload on its way out
        raise RuntimeError("rank 1 fails")
dist.destroy_process_group()
"""


def test_the_nodes_told_of_a_stop_after_the_raising_rank_exits_call_no_hang_meanwhile(workdir, launch) -> None:
    """Acceptance 25A F4: while the stop waited for the raising rank's node (its rank exiting
    for 4 s), the other node's rank, waiting on it in a collective, was called hung."""
    nodes = _pair(workdir, launch, "slow_exit.py", RAISES_WITH_A_SLOW_EXIT, "slowexit", "--max-restarts", "1",
                  "--grace-period", "8")
    for node in nodes:
        code, _, err = node.wait(120)
        assert code == 0, err
    events = read_events(workdir / "logs")
    faults = {(e["fault_kind"], e.get("rank")) for e in events if e["kind"] == "fault"}
    # Rank 0 fails on its lost peer once rank 1 has exited; nobody was hung meanwhile.
    assert ("exception", 1) in faults and not [f for f in faults if f[0] == "hang"], faults
    decisions = [e for e in events if e["kind"] == "decision"]
    assert len(decisions) == 1 and "rank 1 fails" in decisions[0]["reason"], decisions


# A cleanup after the destroy (wandb.finish(), an upload), longer than the grace period.
RAISES_THROUGH_A_SLOW_FINALLY = FINALLY_DESTROY + """\
    if os.environ["RANK"] == "1":
        time.sleep(8)
"""


def test_a_rank_whose_finally_cleans_up_after_destroying_its_group_is_still_the_root_cause(workdir, launch) -> None:
    """Acceptance 26A F2: the peer's lost connection stopped the attempt; the stop waited 1 s
    for the raising rank's report, then stopped it in its cleanup, and the victim was the cause."""
    nodes = _pair(workdir, launch, "slow_finally.py", RAISES_THROUGH_A_SLOW_FINALLY, "slowfinally",
                  "--max-restarts", "0")
    for node in nodes:
        code, _, err = node.wait(120)
        assert code == 1, err
        assert "unicron: error: rank 1 on" in err and "raised KeyError: 'missing_key_in_batch'" in err, err


def test_a_spare_node_waiting_for_a_place_ends_with_the_job(workdir, launch) -> None:
    """A third agent for a full 2-node job waits for a place; when the job ends it is told so
    and exits at once with one line (it used to wait silently for the 600 s join timeout)."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", steps=200, sleep=0.05), workdir, env)
    b = launch(agent_args(workdir, port, "2", steps=200, sleep=0.05), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"], 60, "the attempt")
    spare = launch(agent_args(workdir, port, "2", steps=200, sleep=0.05), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "join_refused"], 60, "the spare waiting")
    for item in (a, b):
        code, out, err = item.wait(90)
        assert code == 0, err
    ended_at = time.monotonic()
    code, out, err = spare.wait(30)
    assert code == 4, err
    assert time.monotonic() - ended_at < 20
    assert "no place for this node yet (job is full" in err
    assert "ended: all workers finished successfully" in err or "stopped answering while this node waited" in err, err


def test_a_node_started_with_other_hang_settings_is_refused_in_one_line(workdir, launch) -> None:
    """--hang-floor on one node only would be silently ignored by the others' hang calls."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    first = launch(agent_args(workdir, port, "2", steps=5), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "join"], 60, "the first node")
    other = launch(agent_args(workdir, port, "2", "--hang-floor", "10", steps=5), workdir, env)
    code, out, err = other.wait(60)
    assert code == 4, err
    lines = [line for line in err.splitlines() if line.startswith("unicron: error:")]
    assert lines == ["unicron: error: the coordinator refused this node: hang settings differ from the job's (give "
                     "every node the same): this node has --hang-floor 10.0, the job's 1.5"], err
    assert first.proc.poll() is None  # still waiting for a second node


def test_a_rank_that_ends_early_on_another_node_is_named_at_the_first_failure(workdir, launch) -> None:
    """Node b's script stops after 10 steps (its own arguments), destroying its process group,
    while node a's trains on and then loses its peer in a collective. The stop's answers must
    name b's rank as the cause at once, whichever report reached the coordinator first: its
    peers' collectives fail on its closed process group before it even exits (acceptance pass
    14: the first decision blamed the victim, 'lost its connection to a peer')."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    a = launch(agent_args(workdir, port, "2", "--max-restarts", "0", steps=30), workdir, env)
    b = launch(agent_args(workdir, port, "2", "--max-restarts", "0", steps=10), workdir, env)
    results = [item.wait(90) for item in (a, b)]
    assert all(code != 0 for code, _, _ in results), results
    decisions = [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    assert len(decisions) == 1 and decisions[0]["rule"] == "uneven-end", decisions
    assert "after step 10 exited with code 0" in decisions[0]["reason"], decisions[0]


def test_a_one_node_job_whose_port_is_taken_fails_at_once(workdir) -> None:
    """`--nnodes 1 --master-port P` with P held by another process (a stale job, another user's
    service): torchrun fails on the port at once; so does unicron, where it used to take the
    listener for its coordinator and wait up to 600 s (acceptance pass 14)."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        (workdir / "hi.py").write_text("print('hi')\n")
        code, out, err = run_unicron(["run", "--nnodes", "1", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                                      "--master-port", str(port), str(workdir / "hi.py")], workdir, timeout=30)
    finally:
        holder.close()
    assert code == 2, out + err
    assert f"cannot listen on port {port}: another process listens there" in err, err
    assert "hi" not in out


def test_a_one_node_job_that_joins_a_coordinator_elsewhere_without_a_secret_is_refused_at_once(workdir) -> None:
    """Its drawn secret could match no coordinator but its own: it used to wait out the join
    timeout (600 s) asking a question."""
    code, _out, err = run_unicron(["run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                   "--rdzv-endpoint", "192.0.2.1:29411", "--rdzv-id", "x",
                                   str(workdir / "train_state.py")], workdir, timeout=60, env=clean_env())
    assert code == 2, err
    assert "needs the same secret on every node" in err and "192.0.2.1 is not this machine" in err, err


def test_a_console_that_goes_away_costs_its_lines_not_the_job(workdir) -> None:
    """``unicron run ... 2>&1 | head``: once the reader is gone every console line fails with
    EPIPE. The job still heals and finishes (torchrun's does); the event log has it all."""
    import subprocess

    from e2e import unicron_cmd

    args = ["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--redirects", "3",
            "--log-dir", str(workdir / "logs"), "--inject", "kill@1:8", str(workdir / "train_state.py"), "--no-state",
            "--steps", "20", "--sleep", "0.05", "--out", str(workdir / "out.txt")]
    proc = subprocess.Popen(unicron_cmd(*args), cwd=workdir, env=clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    assert proc.stderr is not None
    proc.stderr.readline()  # the first line, then the reader leaves
    proc.stderr.close()
    assert proc.wait(120) == 0
    events = read_events(workdir / "logs")
    assert [e["action"] for e in events if e["kind"] == "decision"] == ["restart"], events
    assert (workdir / "out.txt").exists()


def test_the_node_hosting_the_coordinator_defines_the_job_whoever_joins_first(workdir, launch) -> None:
    """A guest started first with another --nnodes used to define the job, and the host's own
    agent was refused by its own coordinator, told the guest's values as its own."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    wrong = launch(agent_args(workdir, port, "3", steps=3, sleep=0, rdzv_conf="last_call_timeout=1,is_host=0"),
                   workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "agent_start"], 60,
             "the misconfigured guest to start")
    host = launch(agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="last_call_timeout=1,is_host=1"),
                  workdir, env)
    code, _out, err = wrong.wait(90)
    assert code == 4 and "--nnodes mismatch: this node says 3:3, the job is 2:2" in err, err
    right = launch(agent_args(workdir, port, "2", steps=3, sleep=0, rdzv_conf="last_call_timeout=1,is_host=0"),
                   workdir, env)
    for item in (host, right):
        code, _out, err = item.wait(90)
        assert code == 0, err


def test_two_nodes_given_the_same_node_rank_still_form_the_job(workdir, launch) -> None:
    """A copied command line: both nodes say --node-rank 0. torchrun's c10d ignores the flag and
    runs; unicron used to leave both waiting for the other until the join timeout."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    agents = [launch(agent_args(workdir, port, "2", "--node-rank", "0", steps=3, sleep=0), workdir, env)
              for _ in range(2)]
    results = [item.wait(90) for item in agents]
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    # said on the console of the node that got another rank (and on the coordinator's)
    moved = next(err for _, _, err in results if "rank 1 of 2" in err)
    assert "--node-rank 0 is already taken" in moved, [err for _, _, err in results]


SAVES_ON_SIGTERM = """
import signal, sys, time
import torch, torch.distributed as dist

def save(*_):  # a preemption handler: a checkpoint that takes longer than the heartbeat timeout
    time.sleep(4)
    sys.exit(0)

signal.signal(signal.SIGTERM, save)
dist.init_process_group("gloo")
t = torch.ones(1)
for step in range(int(sys.argv[1])):
    dist.all_reduce(t)
    if step == 3:
        print("running", flush=True)
    time.sleep(0.05)
dist.destroy_process_group()
"""


def test_an_interrupted_node_whose_workers_stop_slowly_leaves_rather_than_being_lost(workdir, launch) -> None:
    """Node b (not hosting the coordinator) gets SIGTERM and its workers take 4 s to stop: it
    says it leaves first, so the coordinator records why, not "stopped answering heartbeats"."""
    (workdir / "saves.py").write_text(SAVES_ON_SIGTERM)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)

    def args() -> list[str]:
        return ["run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "meshjob", "--rdzv-conf", "last_call_timeout=1", "--max-restarts", "3",
                "--grace-period", "10", "--redirects", "1", "--log-dir", str(workdir / "logs"),
                str(workdir / "saves.py"), "80"]

    a = launch(args(), workdir, env)
    wait_for(lambda: socket.socket().connect_ex(("127.0.0.1", port)) == 0, 60, "a's coordinator to listen")
    b = launch(args(), workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "attempt_start"
                      and e.get("nnodes") == 2], 90, "the two-node attempt")
    _wait_for_output(workdir, "running", 2)
    b.proc.send_signal(signal.SIGTERM)
    code_b, _, err_b = b.wait(60)
    assert code_b == 143, err_b
    left = wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] in ("leave", "node_lost")], 30,
                    "the coordinator to hear of b")
    assert left[0]["kind"] == "leave" and "interrupted by SIGTERM" in str(left[0].get("reason")), left
    code_a, _, err_a = a.wait(120)
    assert code_a == 0, err_a


def test_a_hang_in_a_job_of_two_nodes_names_whose_ranks_stalled_and_the_culprit(workdir, launch) -> None:
    # Each agent sees its own ranks only: the stalled ranks its verdict lists are its node's,
    # and the line says so; the stuck rank (rank 1, on the other node) is named as the culprit.
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    agents = [launch(agent_args(workdir, port, "2", "--inject", "hang@1:8", "--max-restarts", "1", steps=16,
                                sleep=0.02), workdir, env) for _ in range(2)]
    for item in agents:
        code, out, err = item.wait(120)
        assert code == 0, err
    events = read_events(workdir / "logs")
    hangs = [e for e in events if e["kind"] == "fault" and e.get("fault_kind") == "hang"]
    assert hangs and all("by this node's rank(s)" in e["message"] for e in hangs), hangs
    assert next(e for e in events if e["kind"] == "decision")["culprits"] == [1]


def test_ctrl_c_while_the_job_forms_says_no_worker_was_stopped(workdir, launch) -> None:
    """Acceptance 27B F11: a Ctrl-C while the node waited for the other to join said
    "interrupted by SIGINT; all workers stopped", though no worker had started."""
    port = free_port()
    a = launch(agent_args(workdir, port, "2", steps=5, sleep=0), workdir, clean_env(UNICRON_SECRET=SECRET))
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "join"], 60, "node a to join")
    a.proc.send_signal(signal.SIGINT)
    code, _, err = a.wait(60)
    assert code == 130, err
    assert err.rstrip().endswith("unicron: error: interrupted by SIGINT"), err


def _signed_garbage(port: int, job: str, node_id: str, attempt: int) -> int:
    """Messages signed with the job's secret whose values inside no handler takes: a fault of an
    unknown kind, a GPU index that is text, culprit ranks that are not ranks, workers that are not
    objects. Returns how many were sent."""
    fault = {"kind": "exit", "ts": time.time(), "rank": 0, "attempt": attempt, "exitcode": 1}
    bodies = [("fault", {"node_id": node_id, "attempt": attempt, "fault": dict(fault, **bad)})
              for bad in ({"kind": "martian"}, {"gpu": "x"}, {"culprit_ranks": [None]})]
    bodies.append(("heartbeat", {"node_id": node_id, "epoch": 1, "attempt": attempt, "workers": [1], "health": {}}))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for seq, (kind, body) in enumerate(bodies, 1):
        sock.send(_unchecked(kind, body, job, seq))
    sock.close()
    return len(bodies)


def _unchecked(kind: str, body: dict, job: str, seq: int) -> bytes:
    """``kind`` signed with the job's secret, without the sender's own schema check (which refuses it)."""
    from unicron.proto.messages import PROTOCOL_VERSION, sign

    payload = {"v": PROTOCOL_VERSION, "kind": kind, "job": job, "sender": "evil", "seq": seq, "ts": time.time(),
               "body": body}
    return json.dumps(dict(payload, mac=sign(SECRET.encode(), payload))).encode()


@pytest.mark.timeout(120)
def test_signed_faults_with_values_no_handler_takes_are_dropped_and_the_job_trains_on(workdir, launch) -> None:
    """Acceptance 29B F1: one signed fault of kind "martian" (or a text GPU index) was taken,
    and failed the job in the coordinator's tick: every node exited 1 with a traceback."""
    port = free_port()
    run = launch(agent_args(workdir, port, "1", steps=80, sleep=0.1), workdir, clean_env(UNICRON_SECRET=SECRET))

    def status() -> dict | None:
        try:
            msg = request(f"127.0.0.1:{port}", "status_req", {}, job="meshjob", key=SECRET.encode(), timeout_s=2,
                          expect="status")
        except Exception:  # noqa: BLE001 - not listening yet
            return None
        snap = msg.body["snapshot"]
        return snap if snap["job"]["state"] == "running" and snap["nodes"] else None

    snap = wait_for(status, 60, "the job to run")
    before = snap["job"]["dropped_messages"]
    sent = _signed_garbage(port, "meshjob", snap["nodes"][0]["node_id"], snap["job"]["attempt"])
    wait_for(lambda: (s := status()) is not None and s["job"]["dropped_messages"] >= before + sent, 30,
             "the coordinator to drop every bad message")
    code, out, err = run.wait(90)
    assert code == 0, err
    assert "Traceback" not in out + err and "coordinator error" not in out + err
    # Said once for the peer that sent them (30B F7: dropped without a word).
    assert err.count("that fails its schema") == 1 and "more from it are dropped without a word" in err, err
    events = read_events(workdir / "logs")
    assert [e["exit_code"] for e in events if e["kind"] == "job_end"] == [0]
    assert not [e for e in events if e["kind"] == "fault"]
