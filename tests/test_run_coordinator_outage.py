"""The coordinator out for a while under a running 2-node job. A standalone coordinator
SIGKILLed and started again on its port: the job trains on meanwhile, and the new coordinator
takes it back from what the agents tell it (``unicron.coord.resume``), with nothing lost, or
restarting on a fault that happened while no coordinator listened, from memory. The node that
hosts the embedded coordinator frozen whole for longer than the silence that ends an agent over a
closed connection: its connection stays open, so the other node waits, and nothing is lost."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
from e2e import clean_env, read_events, run_unicron, wait_for
from test_run_mesh import (
    SECRET,
    _assert_untouched_job_finished,
    _snapshot_steps_of,
    _stop_tree,
    _two_nodes,
    agent_args,
    free_port,
)

pytestmark = pytest.mark.slow


def _coordinator(launch, workdir, port: int, name: str, env: dict[str, str]):
    item = launch(["coordinator", "--port", str(port), "--host", "127.0.0.1", "--log-dir", str(workdir / name)],
                  workdir, env)
    wait_for(lambda: psutil.Process(item.proc.pid).net_connections("tcp") if item.proc.poll() is None else True,
             30, f"coordinator {name} to listen")
    assert item.proc.poll() is None, item.wait(5)
    return item


def _workers_of(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "train_state.py" in " ".join(p.cmdline()) and "zygote" not in " ".join(p.cmdline())]


@pytest.mark.parametrize("fault_while_down, stop_with", [(False, signal.SIGKILL), (True, signal.SIGKILL),
                                                        (False, signal.SIGTERM)],
                         ids=["untouched", "fault-while-down", "stopped-by-sigterm"])
def test_a_restarted_coordinator_takes_its_job_back(workdir, launch, fault_while_down: bool,
                                                    stop_with: signal.Signals) -> None:
    # Crashed (SIGKILL), or stopped on purpose for an upgrade (SIGTERM: systemd's restart, kill,
    # Ctrl-C): either way the jobs train on, and the coordinator started again takes them back.
    steps = ["--steps", "60"]
    code, _, err = run_unicron(["run", "--standalone", "--nproc-per-node", "2", "--log-dir", str(workdir / "ref"),
                                str(workdir / "train_state.py"), *steps, "--out", str(workdir / "ref.txt")], workdir)
    assert code == 0, err
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
            "--rdzv-id", "meshjob", "--max-restarts", "3", "--grace-period", "2", "--log-dir",
            str(workdir / "logs"), str(workdir / "train_state.py"), *steps, "--sleep", "0.1",
            "--out", str(workdir / "out.txt")]
    a, b = launch(args, workdir, env), launch(args, workdir, env)
    wait_for(lambda: [s for s in _snapshot_steps_of(b.proc.pid) if s >= 5], 90, "node b to snapshot step 5")
    first.proc.send_signal(stop_with)
    code, _, err = first.wait(20)
    if stop_with == signal.SIGTERM:
        assert code == 0 and "stopped by SIGTERM; 1 job(s) left to a successor (meshjob): start it again" in err, err
    step = max(_snapshot_steps_of(b.proc.pid))
    if fault_while_down:
        # A worker dies with nobody to decide: both agents report it to a coordinator that is gone.
        for proc in _workers_of(b.proc.pid):
            proc.send_signal(signal.SIGKILL)
        wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "fault"], 30, "the fault")
    else:
        wait_for(lambda: [s for s in _snapshot_steps_of(b.proc.pid) if s >= step + 5], 60,
                 "five more steps with no coordinator")
    second = _coordinator(launch, workdir, port, "coord2", env)
    results = [item.wait(120) for item in (a, b)]
    for code, out, err in results:
        assert code == 0, out + err
        assert "does not know this job" in err and "took the job back" in err, err
    assert (workdir / "out.txt").read_text() == (workdir / "ref.txt").read_text()
    events = read_events(workdir / "coord2")
    kinds = [e["kind"] for e in events]
    assert kinds.count("job_resumed") == 1 and kinds.count("node_resumed") == 2, kinds
    assert [e["exit_code"] for e in events if e["kind"] == "job_end"] == [0]
    started = [e for e in read_events(workdir / "logs") if e["kind"] == "workers_started"]
    if fault_while_down:
        decisions = [e for e in events if e["kind"] == "decision"]
        assert [d["action"] for d in decisions] == ["restart"], decisions
        restarts = [e for e in events if e["kind"] == "attempt_start"]
        assert len(restarts) == 1 and restarts[0]["restore_step"] is not None, restarts
        assert len(started) == 4
    else:
        assert "decision" not in kinds and "attempt_start" not in kinds, kinds
        assert len(started) == 2  # one attempt: nothing restarted
    second.proc.send_signal(signal.SIGTERM)
    code, _, err = second.wait(20)
    assert code == 0, err
    # Its console tells what it did (no agent's console shows the coordinator's decisions).
    assert "job 'meshjob': took back attempt 0 (2 node(s), 0 restart(s) spent)" in err, err
    assert ("SEV2 restart" in err) is fault_while_down, err


def test_the_coordinators_node_frozen_for_20_s_costs_nothing(workdir, launch) -> None:
    """Node a (hosting the coordinator) stops whole, launcher and workers, for 20 s: node b's
    ranks cannot step and it hears nothing, for longer than the 15 s after which a coordinator
    whose connection closed is given up. Its connection stays open (a's kernel runs): b waits,
    and when a runs again the job goes on with one attempt (torchrun rides out such a freeze)."""
    a, b = _two_nodes(workdir, launch, agent_args(workdir, free_port(), "2", steps=120, sleep=0.1), snapshot_step=5)
    _stop_tree(a.proc.pid, 20)
    _assert_untouched_job_finished(workdir, a, b)


NO_STEPS = """\
import os, sys, time
import torch, torch.distributed as dist

dist.init_process_group("gloo")
count = int(sys.argv[2])
for i in range(count):  # no optimizer, no unicron.step(): a script that reports no steps
    t = torch.ones(4)
    dist.all_reduce(t)
    with open(sys.argv[1], "w") as fh:
        fh.write(str(i + 1))
    time.sleep(0.1)
dist.destroy_process_group()
"""


def test_a_one_node_job_that_reports_no_steps_trains_on_through_a_long_coordinator_outage(workdir, launch) -> None:
    """A standalone coordinator down for longer than the 15 s after which an agent gives up a
    silent coordinator: a one-node job's ranks wait on nobody, so while they all run it trains
    on, steps or not (acceptance pass 14: a script without torch.optim lost its job), and the
    coordinator started again takes it back."""
    (workdir / "nosteps.py").write_text(NO_STEPS)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)
    progress = workdir / "progress.txt"
    job = launch(["run", "--nnodes", "1", "--nproc-per-node", "2", "--coordinator", f"127.0.0.1:{port}",
                  "--rdzv-id", "nosteps", "--log-dir", str(workdir / "logs"), str(workdir / "nosteps.py"),
                  str(progress), "400"], workdir, env)

    def done() -> int:
        text = progress.read_text() if progress.exists() else ""
        return int(text) if text.isdigit() else 0

    wait_for(lambda: done() >= 5, 90, "the job to train")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    killed_at = done()
    # 200 more iterations of at least 0.1 s each: well past the 15 s limit, with no coordinator.
    wait_for(lambda: done() >= killed_at + 200 or job.proc.poll() is not None, 120, "20 s of training alone")
    assert job.proc.poll() is None, job.wait(5)
    second = _coordinator(launch, workdir, port, "coord2", env)
    code, out, err = job.wait(120)
    assert code == 0 and done() == 400, out + err
    assert "took the job back" in err, err
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(20)[0] == 0


def test_nodes_whose_ranks_work_between_steps_outlast_a_long_coordinator_outage(workdir, launch) -> None:
    """Every rank writes its shard of a checkpoint for 30 s (I/O: work) while the standalone
    coordinator is down for 18 s, longer than the 15 s after which a node whose ranks neither
    step nor move gives a silent coordinator up (acceptance pass 14: such nodes exited 4 and
    stopped healthy ranks). The coordinator started again takes the job back."""
    import time

    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
            "--rdzv-id", "ckptjob", "--max-restarts", "0", "--log-dir", str(workdir / "logs"),
            str(workdir / "train_state.py"), "--steps", "12", "--sleep", "0.05", "--pause", "io@*:5:30",
            "--out", str(workdir / "out.txt")]
    a, b = launch(args, workdir, env), launch(args, workdir, env)
    wait_for(lambda: (workdir / "out.txt.scratch").exists(), 90, "the checkpoint phase to begin")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(10)
    down_until = time.monotonic() + 18  # the outage itself: longer than the 15 s limit
    while time.monotonic() < down_until:
        assert a.proc.poll() is None and b.proc.poll() is None, (a.wait(5), b.wait(5))
        time.sleep(0.2)
    second = _coordinator(launch, workdir, port, "coord2", env)
    for item in (a, b):
        code, out, err = item.wait(120)
        assert code == 0 and "took the job back" in err, out + err
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(20)[0] == 0


TAIL = """
import os, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
with open(os.path.join(sys.argv[1], f"ran.{dist.get_rank()}.{os.getpid()}"), "w"):
    pass  # one file per run of the script: a rerun of the job would leave more
rank = dist.get_rank()
dist.destroy_process_group()
if rank == 0:
    time.sleep(600)  # a long tail (an upload): the job's end is not confirmed before the coordinator goes
"""


def test_a_node_whose_workers_finished_is_not_rerun_when_a_new_coordinator_fences_it(workdir, launch) -> None:
    """Acceptance 21B F3: the coordinator went and another took its place (with a new job of that
    id, formed by a replaced node) before the job's end was confirmed. The node whose workers had
    all exited 0 was fenced and joined again: the whole job ran once more. It did its part: it
    exits 0, saying the end was not confirmed, as when the coordinator goes silent."""
    (workdir / "tail.py").write_text(TAIL)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)

    def node(name: str) -> Any:
        return launch(["run", "--nnodes", "2", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
                       "--rdzv-id", "tailjob", "--max-restarts", "2", "--grace-period", "1", "--log-dir",
                       str(workdir / name), str(workdir / "tail.py"), str(workdir)], workdir, env)

    a, b = node("a"), node("b")
    finished = wait_for(lambda: [n for n, item in (("a", a), ("b", b))
                                 if [e for e in read_events(workdir / n) if e["kind"] == "workers_finished"]],
                        90, "one node's workers to finish")
    done, tail = (a, b) if finished == ["a"] else (b, a)
    first.proc.send_signal(signal.SIGKILL)
    first.wait(20)
    os.kill(done.proc.pid, signal.SIGSTOP)  # it is heard only once the new coordinator has a job of that id
    try:
        for proc in psutil.Process(tail.proc.pid).children(recursive=True):
            proc.send_signal(signal.SIGKILL)
        tail.proc.send_signal(signal.SIGKILL)  # the tail's node is replaced (a pod restart)
        tail.wait(20)
        _coordinator(launch, workdir, port, "coord2", env)
        node("c")
        wait_for(lambda: [e for e in read_events(workdir / "coord2") if e["kind"] == "join"], 60,
                 "the replacement to form a new job of that id")
    finally:
        os.kill(done.proc.pid, signal.SIGCONT)
    code, _, err = done.wait(60)
    assert code == 0, err
    assert "the job's end was not confirmed (fenced by the coordinator" in err, err
    assert len(list(workdir.glob("ran.*"))) == 2  # each rank ran its script once: nothing ran again


LOADS_FIRST = """
import os, sys, time
import torch, torch.distributed as dist

here = sys.argv[1]
with open(os.path.join(here, f"loading.{os.environ['RANK']}.{os.getpid()}"), "w"):
    pass  # one file per run of the script: a re-formed job would leave more
while not os.path.exists(os.path.join(here, "go")):  # loading a model, for as long as the test says
    time.sleep(0.05)
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
with open(os.path.join(here, f"sum.{dist.get_rank()}"), "w") as fh:
    fh.write(str(int(total.item())))
dist.destroy_process_group()
"""


def test_ranks_loading_before_init_process_group_rendezvous_in_the_store_opened_again(workdir, launch) -> None:
    """Acceptance 23A F1: the standalone coordinator restarted while every rank was still
    loading, before init_process_group. Their store died with it; the new coordinator opens it
    again on its port, and the ranks rendezvous there: the job is not re-formed, nothing redone."""
    (workdir / "loads.py").write_text(LOADS_FIRST)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
            "--rdzv-id", "loadjob", "--max-restarts", "2", "--log-dir", str(workdir / "logs"),
            str(workdir / "loads.py"), str(workdir)]
    a, b = launch(args, workdir, env), launch(args, workdir, env)
    wait_for(lambda: len(list(workdir.glob("loading.*"))) == 2, 90, "both ranks to start loading")
    first.proc.send_signal(signal.SIGKILL)
    first.wait(20)
    second = _coordinator(launch, workdir, port, "coord2", env)
    wait_for(lambda: [e for e in read_events(workdir / "coord2") if e["kind"] == "store_reopened"], 60,
             "the store to be opened again")
    (workdir / "go").touch()
    for item in (a, b):
        code, out, err = item.wait(120)
        assert code == 0 and "took the job back" in err, out + err
    assert [(workdir / f"sum.{r}").read_text() for r in (0, 1)] == ["3", "3"]
    assert len(list(workdir.glob("loading.*"))) == 2  # each rank ran its script once
    kinds = [e["kind"] for e in read_events(workdir / "coord2")]
    assert "attempt_start" not in kinds and "stop" not in kinds, kinds
    second.proc.send_signal(signal.SIGTERM)
    code, _, err = second.wait(20)
    assert code == 0 and "opened the workers' store of attempt 0 again on port" in err, err


def test_a_coordinator_stopped_with_end_jobs_on_exit_ends_its_jobs_and_says_so(workdir, launch) -> None:
    """``--end-jobs-on-exit``: SIGTERM ends every job it serves (their nodes exit 1 with the
    reason) instead of leaving them to a successor; acceptance 25C F5: it said nothing of it."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    coordinator = launch(["coordinator", "--port", str(port), "--host", "127.0.0.1", "--end-jobs-on-exit",
                          "--log-dir", str(workdir / "coord")], workdir, env)
    job = launch(["run", "--nnodes", "1", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
                  "--rdzv-id", "endme", "--log-dir", str(workdir / "logs"), str(workdir / "train_state.py"),
                  "--steps", "2000", "--sleep", "0.05"], workdir, env)
    wait_for(lambda: [e for e in read_events(workdir / "logs") if e["kind"] == "workers_started"], 90,
             "the job to train")
    coordinator.proc.send_signal(signal.SIGTERM)
    code, _, err = coordinator.wait(30)
    assert code == 0 and "stopped by SIGTERM; 1 job(s) ended (endme): their nodes exit 1" in err, err
    code, _, err = job.wait(60)
    assert code == 1 and "the coordinator was stopped by SIGTERM" in err, err


IN_INIT_OR_LOADING = """
import os, sys, time
import torch, torch.distributed as dist

here = sys.argv[1]
if os.environ["GROUP_RANK"] == "0":  # the test waits for its connection to the store
    with open(os.path.join(here, "joining.tmp"), "w") as fh:
        fh.write(f"{os.getpid()} {os.environ['MASTER_PORT']}")
    os.replace(os.path.join(here, "joining.tmp"), os.path.join(here, "joining"))
if os.environ["GROUP_RANK"] == "1":  # loads a model first: node 0's ranks wait in init_process_group
    with open(os.path.join(here, f"loading.{os.environ['RANK']}.{os.getpid()}"), "w"):
        pass
    while not os.path.exists(os.path.join(here, "go")):
        time.sleep(0.05)
dist.init_process_group("gloo")
total = torch.tensor([1.0])
dist.all_reduce(total)
with open(os.path.join(here, f"sum.{dist.get_rank()}"), "w") as fh:
    fh.write(str(int(total.item())))
dist.destroy_process_group()
"""


def test_ranks_in_init_process_group_that_lose_the_store_with_the_coordinator_cost_no_restart(workdir, launch) -> None:
    """Acceptance 26A F1: node 0's ranks waited in init_process_group, node 1's still loaded,
    when the standalone coordinator was killed. Node 0's ranks failed at once on the lost store
    (DistNetworkError), and that was taken for the job's fault: with --max-restarts 0 the job
    failed. It re-forms with a fresh store, spending nothing."""
    (workdir / "mixed.py").write_text(IN_INIT_OR_LOADING)
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    first = _coordinator(launch, workdir, port, "coord1", env)
    nodes = [launch(["run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                     "--coordinator", f"127.0.0.1:{port}", "--rdzv-id", "mixedjob", "--max-restarts", "0",
                     "--log-dir", str(workdir / f"logs{rank}"), str(workdir / "mixed.py"), str(workdir)],
                    workdir, env) for rank in (0, 1)]
    wait_for(lambda: list(workdir.glob("loading.*")), 90, "node 1's rank to load")
    # Node 0's rank in init_process_group, connected to the store: one not connected yet only
    # retries its connect when the store goes (and is re-formed all the same, with no fault).
    pid, store_port = map(int, wait_for(lambda: (workdir / "joining").exists() and (workdir / "joining").read_text(),
                                        60, "node 0's rank to start").split())
    wait_for(lambda: [c for c in psutil.Process(pid).net_connections("tcp")
                      if c.raddr and c.raddr.port == store_port and c.status == psutil.CONN_ESTABLISHED],
             60, "node 0's rank to connect to the store")
    first.proc.send_signal(signal.SIGKILL)
    first.wait(20)
    wait_for(lambda: [e for e in read_events(workdir / "logs0") if e["kind"] == "fault"], 60,
             "node 0's rank to fail on the lost store")
    second = _coordinator(launch, workdir, port, "coord2", env)
    wait_for(lambda: [e for e in read_events(workdir / "coord2") if e["kind"] == "decision"], 60, "the re-form")
    (workdir / "go").touch()
    for node in nodes:
        code, out, err = node.wait(120)
        assert code == 0, out + err
    assert [(workdir / f"sum.{r}").read_text() for r in (0, 1)] == ["2", "2"]
    decisions = [e for e in read_events(workdir / "coord2") if e["kind"] == "decision"]
    assert [(d["severity"], d["action"]) for d in decisions] == [("INFO", "restart")], decisions
    second.proc.send_signal(signal.SIGTERM)
    assert second.wait(20)[0] == 0


def test_a_fault_while_the_coordinator_is_gone_for_good_is_in_the_nodes_last_line(workdir, launch) -> None:
    """Acceptance 27B F6: a rank failed while the standalone coordinator was down for good;
    each node exited 4 with only "lost the coordinator", the rank's failure, which no decision
    came for, nowhere in it."""
    port = free_port()
    env = clean_env(UNICRON_SECRET=SECRET)
    coord = _coordinator(launch, workdir, port, "coord", env)
    node = launch(["run", "--nproc-per-node", "2", "--coordinator", f"127.0.0.1:{port}", "--rdzv-id", "gone",
                   "--grace-period", "2", "--log-dir", str(workdir / "logs"), str(workdir / "train_state.py"),
                   "--steps", "100000", "--sleep", "0.05"], workdir, env)
    # Past init_process_group (the coordinator hosts the store: a rank still in it when the
    # coordinator dies fails on it at once, and that, not the SIGKILL below, is then the fault).
    shm = Path("/dev/shm")
    wait_for(lambda: len({p.parent for p in shm.glob("unicron-gone-*/rank*/step*.pt")}) == 2, 90, "both ranks to step")
    coord.proc.send_signal(signal.SIGKILL)
    coord.wait(20)
    wait_for(lambda: len(_workers_of(node.proc.pid)) == 2, 30, "both workers")
    _workers_of(node.proc.pid)[0].send_signal(signal.SIGKILL)
    code, _, err = node.wait(90)
    last = err.rstrip().splitlines()[-1]
    assert code == 4, err
    assert last.startswith(f"unicron: error: lost the coordinator at tcp://127.0.0.1:{port}"), last
    assert "; before it, this node reported exit on rank " in last and "signal SIGKILL (9)" in last, last
