"""`unicron status --json` and the Prometheus endpoint against a real job that heals."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request

import pytest
from e2e import clean_env, read_events, unicron_cmd, wait_for

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(workdir, env) -> dict | None:
    proc = subprocess.run(unicron_cmd("status", "--json"), cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=30)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def test_status_json_and_metrics_follow_a_healing_job(workdir, launch) -> None:
    env = clean_env(UNICRON_RUNS_DIR=str(workdir / "runs"))
    mport = _free_port()
    job = launch(["run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--metrics-port", str(mport),
                  "--local-addr", "127.0.0.1",
                  "--log-dir", str(workdir / "logs"), str(workdir / "train_state.py"),
                  "--steps", "400", "--sleep", "0.05"], workdir, env)
    # Before the fault: the JSON snapshot names every rank with its step and pid. The test kills a rank itself
    # once it has seen that snapshot (an injected fault at a fixed step can come before a slow `status`).
    # The script snapshots with unicron.State: each rank's newest snapshot comes with its steps.
    snap = wait_for(lambda: (s := _status(workdir, env)) and any(
        w.get("step", 0) >= 2 and w.get("snapshot_step") for n in s["nodes"] for w in n["workers"]) and s,
        90, "a status with steps and snapshots")
    workers = {w["rank"]: w for n in snap["nodes"] for w in n["workers"]}
    assert sorted(workers) == [0, 1]
    assert all(isinstance(w["step"], int) for w in workers.values())
    assert any(1 <= (w["snapshot_step"] or 0) <= w["step"] for w in workers.values())
    assert snap["job"]["state"] == "running" and snap["job"]["restarts"] == 0
    assert snap["job"]["coordinator"].startswith("127.0.0.1:"), snap["job"]  # where nodes reach it: --local-addr
    os.kill(workers[1]["pid"], signal.SIGKILL)
    # After the kill: one restart, visible in status and in metrics.
    snap = wait_for(lambda: (s := _status(workdir, env)) and s["job"]["restarts"] == 1
                    and s["job"]["state"] == "running" and s, 90, "the restart in status")
    assert snap["restarts"][0]["severity"] == "SEV2"
    text = wait_for(lambda: (t := _scrape(mport)) and "unicron_restarts_total{" in t and t, 30, "metrics")
    assert 'unicron_restarts_total{job="' in text
    assert "unicron_downtime_seconds_total" in text
    assert [e for e in read_events(workdir / "logs") if e["kind"] == "decision"]
    # Both attempts' stores came from the zygote's store host: the launcher never imported torch.
    with open(f"/proc/{job.proc.pid}/maps") as maps:
        assert "libtorch" not in maps.read()
    job.kill()


def test_status_without_runs_is_a_clear_error(workdir) -> None:
    env = clean_env(UNICRON_RUNS_DIR=str(workdir / "none"))
    proc = subprocess.run(unicron_cmd("status", "--json"), cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "unicron: error:" in proc.stderr
    assert not (workdir / "none").exists()  # a reader writes nothing (acceptance 25C F5)


def test_a_run_trains_when_the_runs_dir_cannot_be_used(workdir) -> None:
    """The registry only serves `unicron status`: a run whose runs directory is unusable (here a
    file; read-only or someone else's alike) says so in one line and trains anyway."""
    taken = workdir / "a-file"
    taken.write_text("")
    script = workdir / "ok.py"
    script.write_text("import os\nprint(f\"rank {os.environ['RANK']} done\")\n")
    env = clean_env(UNICRON_RUNS_DIR=str(taken))
    proc = subprocess.run(unicron_cmd("run", "--standalone", "--nproc-per-node", "2", str(script)), cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    warned = [line for line in proc.stderr.splitlines() if "cannot use" in line]
    assert len(warned) == 1 and f"UNICRON_RUNS_DIR: cannot use {taken}" in warned[0], proc.stderr
    assert "`unicron status` will not find this run" in warned[0] and "Traceback" not in proc.stderr


def test_an_ended_jobs_status_still_lists_every_rank_and_the_one_that_failed(workdir, launch) -> None:
    """Acceptance 25C F1: a standalone coordinator keeps showing a job that failed, but the
    ranks of nodes that had stopped their workers were gone from it (heartbeats after the stop
    said no workers), and a failed rank was shown as its node's ``left``."""
    from test_run_coordinator_outage import _coordinator
    from test_run_mesh import SECRET

    port = _free_port()
    env = clean_env(UNICRON_SECRET=SECRET, UNICRON_RUNS_DIR=str(workdir / "runs"))
    coordinator = _coordinator(launch, workdir, port, "coord", env)
    args = ["run", "--nnodes", "2", "--nproc-per-node", "1", "--coordinator", f"127.0.0.1:{port}",
            "--rdzv-id", "endjob", "--max-restarts", "0", "--inject", "exception@1:5", "--log-dir",
            str(workdir / "logs"), str(workdir / "train_state.py"), "--steps", "40", "--sleep", "0.05"]
    nodes = [launch(args, workdir, env), launch(args, workdir, env)]
    for node in nodes:
        assert node.wait(120)[0] == 1
    proc = subprocess.run(unicron_cmd("status", "--json", "--job", "endjob"), cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["job"]["state"] == "failed"
    states = {w["rank"]: w["state"] for n in snap["nodes"] for w in n["workers"]}
    # Rank 0 is stopped, or fails first on its broken collective (gloo's peer is gone).
    assert states[1] == "failed" and states[0] in ("stopped", "failed") and len(states) == 2, snap["nodes"]
    coordinator.proc.send_signal(signal.SIGTERM)
    assert coordinator.wait(20)[0] == 0
