"""`unicron status` against real sockets: silent, closed, answering, and a coordinator that goes away."""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import typer
import zmq
from e2e import wait_for
from rich.console import Console
from typer.testing import CliRunner

from unicron.errors import ConfigError, EndpointUnreachableError, ProtocolError, UnicronError
from unicron.events import EventLog
from unicron.proto.messages import Codec
from unicron.runs import RunInfo, register_run
from unicron.status.client import Target, WatchState
from unicron.status.commands import register
from unicron.status.samples import failing_snapshot, healed_snapshot
from unicron.status.watch import SnapshotPoller, frame_for, run_watch

JOB = "gpt-demo"
KEY = b"test-secret-0123456789"


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run a command as the lead's main() does: a UnicronError becomes its exit code and one line."""
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, args, env=env, standalone_mode=False)
    if isinstance(result.exception, UnicronError):
        return result.exception.exit_code, str(result.exception)
    if result.exception is not None:
        raise result.exception
    return 0, result.output


Responder = Callable[[int], "dict[str, Any] | None"]


class FakeCoordinator:
    """A ROUTER on an OS-chosen port that answers status_req with signed snapshots.

    ``respond(n)`` decides the answer to the n-th request: a snapshot, or None to stay silent
    (as a coordinator busy in a transition, or gone, would).
    """

    def __init__(self, respond: Responder, job: str = JOB, key: bytes = KEY) -> None:
        self.respond = respond
        self.codec = Codec(key, "coordinator-test", job=job)
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.port = int(self.sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.endpoint = f"127.0.0.1:{self.port}"
        self.requests = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.sock.poll(50, zmq.POLLIN):
                continue
            identity, raw = self.sock.recv_multipart()
            try:
                msg = self.codec.decode(raw)
            except ProtocolError:
                continue  # as the real coordinator: drop what cannot be verified
            if msg.kind != "status_req":
                continue
            n, self.requests = self.requests, self.requests + 1
            snapshot = self.respond(n)
            if snapshot is not None:
                self.sock.send_multipart([identity, self.codec.encode("status", {"snapshot": snapshot})])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close(0)


@pytest.fixture()
def coordinator() -> Iterator[Callable[[Responder], FakeCoordinator]]:
    made: list[FakeCoordinator] = []

    def make(respond: Responder) -> FakeCoordinator:
        made.append(FakeCoordinator(respond))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture()
def runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "runs"
    monkeypatch.setenv("UNICRON_RUNS_DIR", str(d))
    monkeypatch.delenv("UNICRON_SECRET", raising=False)
    return d


def register_local(tmp_path: Path, endpoint: str, pid: int, job: str = JOB) -> None:
    secret = tmp_path / f"{job}.secret"
    secret.write_bytes(KEY + b"\n")
    register_run(RunInfo(job=job, endpoint=endpoint, pid=pid, secret_file=str(secret), log_dir=str(tmp_path),
                         started_at=time.time()))


def snapshot_with(state: str, attempt: int = 0) -> dict[str, Any]:
    snap = healed_snapshot(time.time())
    snap["job"].update(state=state, attempt=attempt, restarts=attempt)
    return snap


# -- endpoints that do not answer ------------------------------------------------------------

def test_silent_endpoint_is_one_error_within_the_timeout(runs_dir: Path) -> None:
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # bound, accepts, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    port = silent.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        start = time.monotonic()
        code, msg = invoke(["status", "--endpoint", f"127.0.0.1:{port}", "--job", JOB, "--timeout", "0.5"],
                           env={"UNICRON_SECRET": KEY.decode()})
        elapsed = time.monotonic() - start
    finally:
        silent.close(0)
    assert code == EndpointUnreachableError.exit_code
    assert msg.startswith(f"no answer from 127.0.0.1:{port} within 0.5 s") and "\n" not in msg
    assert elapsed < 10  # the 0.5 s timeout ends the wait, not the test's (a bound, not a timing)


def test_a_local_run_whose_process_is_stopped_is_said_to_be(runs_dir: Path, tmp_path: Path) -> None:
    """Acceptance 25C F5: a frozen run got "is it running, and are --job and the secret right?"."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # its coordinator, frozen with its process
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    port = silent.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        wait_for(lambda: psutil.Process(frozen.pid).status() == psutil.STATUS_STOPPED, 10, "the process to stop")
        register_local(tmp_path, f"127.0.0.1:{port}", frozen.pid)
        code, msg = invoke(["status", "--job", JOB, "--timeout", "0.5"])
    finally:
        frozen.kill()
        frozen.wait()
        silent.close(0)
    assert code == 5 and f"its process {frozen.pid} is stopped" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("watch", [[], ["--watch"]])
def test_closed_port_is_one_error_within_the_timeout(runs_dir: Path, watch: list[str]) -> None:
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    probe.bind("tcp://127.0.0.1:0")
    port = probe.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    probe.close(0)  # nothing listens there any more
    start = time.monotonic()
    code, msg = invoke(["status", "-e", f"127.0.0.1:{port}", "-j", JOB, *(watch or ["--json"]), "--timeout", "0.5"],
                       env={"UNICRON_SECRET": KEY.decode()})  # --watch: it never had a snapshot to show
    assert code == 5 and "no answer" in msg
    assert time.monotonic() - start < 3


def test_an_unusable_runs_dir_is_one_line_naming_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    taken = tmp_path / "a-file"
    taken.write_text("")
    env = {**os.environ, "UNICRON_RUNS_DIR": str(taken)}
    proc = subprocess.run([sys.executable, "-m", "unicron", "status"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"unicron: error: UNICRON_RUNS_DIR: cannot use {taken} as the directory of "
                                   "live runs: File exists")


def test_the_default_runs_dir_ignores_tmpdir_and_must_be_this_users_own(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Acceptance 19C F5: a run started under a batch job's own TMPDIR was invisible to `unicron
    status` from a shell without it. 19C F3: in a shared /tmp another user could make the
    directory first (mode 777), plant runs in this user's status, or remove theirs."""
    import unicron.runs as runs

    monkeypatch.delenv("UNICRON_RUNS_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert runs.default_runs_base() == "/tmp"
    monkeypatch.setattr(runs, "default_runs_base", lambda: str(tmp_path))
    mine = tmp_path / f"unicron-runs-{os.getuid()}"
    assert runs.runs_dir() == mine and stat.S_IMODE(mine.stat().st_mode) == 0o700
    mine.chmod(0o777)  # as another user would have made it
    with pytest.raises(ConfigError, match="is not this user's own .*mode 777.*remove it, or set UNICRON_RUNS_DIR"):
        runs.runs_dir()
    if os.geteuid() == 0:
        mine.chmod(0o700)
        os.chown(mine, 65534, 65534)
        with pytest.raises(ConfigError, match="owner uid 65534"):
            runs.runs_dir()


def test_no_run_on_this_machine(runs_dir: Path) -> None:
    code, msg = invoke(["status"])
    assert code == 5 and msg.startswith("no unicron run found on this machine")


def test_a_malformed_registry_entry_is_skipped_not_an_internal_error(runs_dir: Path) -> None:
    """Acceptance 21C F6: a hand-edited entry (or another version's) with a field of the wrong
    type hid every run behind an internal error, exit 70."""
    runs_dir.mkdir(mode=0o700)
    base = {"job": "b", "endpoint": "127.0.0.1:1", "pid": os.getpid(), "secret_file": "", "log_dir": "",
            "started_at": 1.0}
    for i, bad in enumerate([{"pid": str(os.getpid())}, {"pid": 10**20}, {"secret_file": None}, {"job": [1]},
                             {"started_at": "x"}]):
        (runs_dir / f"bad{i}.{os.getpid()}.json").write_text(json.dumps(dict(base, **bad)))
    code, msg = invoke(["status"])
    assert code == 5 and msg.startswith("no unicron run found on this machine"), msg


@pytest.mark.parametrize("value", ["nan", "inf", "1e300", "-1", "0"])
def test_a_wait_that_is_not_a_number_of_seconds_is_misuse(runs_dir: Path, value: str) -> None:
    code, msg = invoke(["status", "-e", "127.0.0.1:1", "--job", JOB, "--timeout", value],
                       env={"UNICRON_SECRET": "x"})
    assert code == 2 and "--interval and --timeout must be positive seconds" in msg, msg


def test_endpoint_needs_job_and_secret(runs_dir: Path) -> None:
    assert invoke(["status", "-e", "127.0.0.1:1"])[0] == 2
    code, msg = invoke(["status", "-e", "127.0.0.1:1", "--job", JOB])
    assert code == 2 and "UNICRON_SECRET" in msg
    code, msg = invoke(["status", "-e", "nonsense", "--job", JOB], env={"UNICRON_SECRET": "x"})
    assert code == 2 and "expected HOST:PORT" in msg  # bad input, not a silent coordinator
    code, msg = invoke(["status", "-e", "nonsense"])  # said first, before what else is missing
    assert code == 2 and "expected HOST:PORT" in msg
    for port in ("99999", "0"):
        code, msg = invoke(["status", "-e", f"127.0.0.1:{port}", "--job", JOB], env={"UNICRON_SECRET": "x"})
        assert code == 2 and "port must be 1..65535" in msg
    code, msg = invoke(["status", "-e", "127.0.0.1:1", "--job", JOB, "--secret-file", str(runs_dir / "none")])
    assert code == 2 and "cannot read secret file" in msg


@pytest.mark.timeout(60)
def test_a_wrong_job_id_at_a_local_runs_endpoint_is_named_as_such(runs_dir: Path, tmp_path: Path,
                                                                   coordinator) -> None:
    """Acceptance 29C F6: it said "no secret for ...", which sent the user after the wrong thing."""
    c = coordinator(lambda n: snapshot_with("running"))
    register_local(tmp_path, c.endpoint, os.getpid())
    code, msg = invoke(["status", "-e", c.endpoint, "--job", "wrongid"])
    assert code == 2 and msg == (f"no unicron run known here serves job 'wrongid' at {c.endpoint} (it serves "
                                 f"'{JOB}'; or set UNICRON_SECRET to ask it anyway)")
    code, out = invoke(["status", "-e", c.endpoint, "--job", JOB, "--json"])  # the right one still answers
    assert code == 0 and json.loads(out)["job"]["id"] == JOB


def test_this_machines_name_finds_a_run_registered_by_address() -> None:
    import socket

    from unicron.status.client import _same_endpoint

    assert _same_endpoint(f"{socket.gethostname()}:36599", "127.0.0.1:36599")
    assert _same_endpoint("localhost:36599", "tcp://127.0.1.1:36599")
    assert not _same_endpoint(f"{socket.gethostname()}:36599", "127.0.0.1:36600")
    assert not _same_endpoint("10.9.8.7:36599", "127.0.0.1:36599")


def test_wrong_secret_is_dropped_and_reported_as_no_answer(runs_dir: Path, coordinator) -> None:
    c = coordinator(lambda n: snapshot_with("running"))
    code, msg = invoke(["status", "-e", c.endpoint, "-j", JOB, "--timeout", "0.4"], env={"UNICRON_SECRET": "wrong"})
    assert code == 5 and "are --job and the secret right?" in msg
    assert c.requests == 0  # the signature did not verify


# -- an answering endpoint ---------------------------------------------------------------------

def test_json_snapshot_from_a_real_endpoint(runs_dir: Path, coordinator) -> None:
    c = coordinator(lambda n: healed_snapshot(time.time()))
    code, out = invoke(["status", "--endpoint", c.endpoint, "--job", JOB, "--json"],
                       env={"UNICRON_SECRET": KEY.decode()})
    assert code == 0
    snap = json.loads(out)
    workers = [w for node in snap["nodes"] for w in node["workers"]]
    assert sorted(w["rank"] for w in workers) == [0, 1, 2, 3]
    assert all(type(w["rank"]) is int and type(w["step"]) is int for w in workers)
    assert snap["job"]["id"] == JOB and snap["job"]["state"] == "running"


def test_rich_view_of_a_local_run_found_without_flags(runs_dir: Path, tmp_path: Path, coordinator) -> None:
    c = coordinator(lambda n: failing_snapshot(time.time()))
    register_local(tmp_path, c.endpoint, os.getpid())  # this process hosts the coordinator thread
    code, out = invoke(["status"])
    assert code == 0
    assert "gpt-demo" in out and "restarting" in out and "Xid 79" in out and "SEV1" in out


def test_several_local_runs_give_a_table(runs_dir: Path, tmp_path: Path, coordinator) -> None:
    a = coordinator(lambda n: snapshot_with("running"))
    register_local(tmp_path, a.endpoint, os.getpid(), job=JOB)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:0")
    try:
        register_local(tmp_path, silent.getsockopt_string(zmq.LAST_ENDPOINT)[6:], os.getpid(), job="other")
        code, out = invoke(["status", "--timeout", "0.4"])
        assert code == 0 and "2 unicron runs" in out and "no answer" in out and "pick one with --job" in out
        code, msg = invoke(["status", "--json"])
        assert code == 2 and "pick one with --job" in msg
        code, out = invoke(["status", "--json", "--job", JOB])
        assert code == 0 and json.loads(out)["job"]["id"] == JOB
    finally:
        silent.close(0)


# -- watching through a failure ------------------------------------------------------------------

def test_watch_keeps_going_through_an_outage_and_exits_when_the_run_ends(runs_dir: Path, coordinator) -> None:
    script = [snapshot_with("running"), None, None, snapshot_with("restarting", 1), snapshot_with("running", 1),
              snapshot_with("done", 1)]
    c = coordinator(lambda n: script[min(n, len(script) - 1)])
    start = time.monotonic()
    code, out = invoke(["status", "-e", c.endpoint, "-j", JOB, "--watch", "--interval", "0.05", "--timeout", "0.3"],
                       env={"UNICRON_SECRET": KEY.decode()})
    assert code == 0 and time.monotonic() - start < 20
    lines = out.splitlines()
    order = [next(i for i, line in enumerate(lines) if pattern in line)
             for pattern in ("gpt-demo running · attempt 0", "reconnecting to", "gpt-demo restarting",
                             "gpt-demo running · attempt 1", "run gpt-demo ended (done)")]
    assert order == sorted(order), lines
    assert lines[-1] == "run gpt-demo ended (done)"


def test_watch_ends_when_the_local_coordinator_process_is_gone(runs_dir: Path, tmp_path: Path, coordinator) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def respond(n: int) -> dict[str, Any] | None:
            if n < 2:
                return snapshot_with("running")
            proc.kill()  # the run dies without saying goodbye
            proc.wait()
            return None

        c = coordinator(respond)
        register_local(tmp_path, c.endpoint, proc.pid)
        code, out = invoke(["status", "--watch", "--interval", "0.05", "--timeout", "0.3"])
    finally:
        proc.kill()
        proc.wait()
    assert code == 0
    assert out.splitlines()[-1] == "run gpt-demo ended (its coordinator is gone; last state: running)"


def test_live_view_in_a_terminal_shows_reconnecting_then_the_end() -> None:
    answers: list[Any] = [healed_snapshot(time.time()), EndpointUnreachableError("no answer from h:1 within 1 s"),
                          failing_snapshot(time.time()), snapshot_with("done", 2)]

    def fetch(target: Target, timeout_s: float) -> dict[str, Any]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    console = Console(record=True, force_terminal=True, width=110, file=io.StringIO())
    poller = SnapshotPoller(Target(JOB, "h:1", KEY), 1.0, fetch=fetch)
    ended = run_watch(console, poller, 0.0, wait=lambda s: None)
    assert ended == "run gpt-demo ended (done)"
    text = console.export_text()
    for expected in ("gpt-demo  running", "reconnecting to h:1", "Xid 79", "run gpt-demo ended (done)"):
        assert expected in text
    assert text.index("reconnecting to h:1") < text.index("Xid 79")


def test_frames_for_each_watch_state() -> None:
    target, now = Target(JOB, "h:1", KEY), time.time()
    state = WatchState()
    assert "waiting for h:1" in frame_for(state, target, now).line
    state.on_error("no answer", now - 2, run_gone=False)
    frame = frame_for(state, target, now)
    # Never answered yet (a run on this machine still starting): waited for, not "reconnecting"
    assert frame.line.startswith("waiting for h:1… (no answer for 2.0s") and not frame.ended
    state.on_snapshot(healed_snapshot(now), now)
    assert frame_for(state, target, now).line.startswith("gpt-demo running") and not state.reconnecting
    state.on_error("no answer", now, run_gone=False)
    assert frame_for(state, target, now).line.startswith("reconnecting to h:1… (last: gpt-demo running")
    state.on_error("no answer", now, run_gone=True)
    assert frame_for(state, target, now).ended == "run gpt-demo ended (its coordinator is gone; last state: running)"
    ended = WatchState(snapshot=healed_snapshot(now))
    ended.on_error("no answer", now, run_gone=True, job_end={"exit_code": 1, "reason": "restart budget spent"})
    assert ended.ended == "run gpt-demo ended (failed, exit 1: restart budget spent)"


def test_watch_reads_how_a_gone_run_ended_from_its_event_log(runs_dir: Path, tmp_path: Path, coordinator) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        def respond(n: int) -> dict[str, Any] | None:
            if n < 1:
                return snapshot_with("running")
            log = EventLog(tmp_path / "events.jsonl", job=JOB)  # what the coordinator logs as it ends
            log.emit("job_end", exit_code=0, reason="all workers finished successfully", restarts=1)
            log.close()
            proc.kill()
            proc.wait()
            return None

        c = coordinator(respond)
        register_local(tmp_path, c.endpoint, proc.pid)  # log_dir = tmp_path
        code, out = invoke(["status", "--watch", "--interval", "0.05", "--timeout", "0.3"])
    finally:
        proc.kill()
        proc.wait()
    assert code == 0
    assert out.splitlines()[-1] == "run gpt-demo ended (done, exit 0: all workers finished successfully)"


def test_two_runs_of_one_job_id_are_told_apart_by_their_endpoints(tmp_path: Path, runs_dir: Path) -> None:
    """Acceptance 19C F2: two one-node jobs of one Slurm allocation share its job id; `status
    --json --job ID` said to pick one with --job, which cannot tell them apart."""
    register_local(tmp_path, "127.0.0.1:1001", os.getpid())
    register_local(tmp_path, "127.0.0.1:1002", os.getppid())
    register_local(tmp_path, "127.0.0.1:1003", os.getpid(), job="other")
    code, msg = invoke(["status", "--json", "--job", JOB])
    assert code == 2 and msg == (f"2 runs of job {JOB!r} on this machine: pick one with --endpoint "
                                 "(127.0.0.1:1001, 127.0.0.1:1002)")
    code, msg = invoke(["status", "--json"])
    assert code == 2 and "pick one with --endpoint" in msg  # the job ids alone repeat


def test_two_runs_of_one_job_id_keep_their_own_entries(tmp_path: Path, runs_dir: Path) -> None:
    """The same --rdzv-id at two endpoints on one machine: both are listed, and the first to end
    removes only its own entry (it used to overwrite the other's, then delete it)."""
    from unicron.runs import list_runs, unregister_run

    register_local(tmp_path, "127.0.0.1:1001", os.getpid())
    register_local(tmp_path, "127.0.0.1:1002", os.getppid())
    assert sorted(r.endpoint for r in list_runs() if r.job == JOB) == ["127.0.0.1:1001", "127.0.0.1:1002"]
    unregister_run(JOB, os.getppid())
    assert [r.endpoint for r in list_runs() if r.job == JOB] == ["127.0.0.1:1001"]
    unregister_run(JOB)  # this process's own
    assert [r for r in list_runs() if r.job == JOB] == []


def test_a_run_registered_with_relative_paths_is_found_from_another_directory(
        runs_dir: Path, tmp_path: Path, coordinator, monkeypatch: pytest.MonkeyPatch) -> None:
    # `unicron run --log-dir logs`: the usual form, and `unicron status` from a second terminal
    # in another directory.
    c = coordinator(lambda n: snapshot_with("running"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "secret").write_bytes(KEY + b"\n")
    monkeypatch.chdir(tmp_path)
    register_run(RunInfo(job=JOB, endpoint=c.endpoint, pid=os.getpid(), secret_file="logs/secret", log_dir="logs",
                         started_at=time.time()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out = invoke(["status", "--json"])
    assert code == 0 and json.loads(out)["job"]["id"] == JOB, out


def test_one_run_whose_secret_is_unreadable_does_not_hide_the_others(runs_dir: Path, tmp_path: Path,
                                                                      coordinator) -> None:
    a = coordinator(lambda n: snapshot_with("running"))
    register_local(tmp_path, a.endpoint, os.getpid(), job=JOB)
    register_run(RunInfo(job="gone-dir", endpoint="127.0.0.1:1", pid=os.getpid(),
                         secret_file=str(tmp_path / "deleted" / "secret"), log_dir=str(tmp_path / "deleted"),
                         started_at=time.time()))
    code, out = invoke(["status", "--timeout", "0.4"])
    assert code == 0 and "2 unicron runs" in out and "secret unreadable" in out and "running" in out, out
    code, msg = invoke(["status", "--job", "gone-dir"])  # asked for by name: the error itself
    assert code == 2 and "cannot read its secret file" in msg, msg


def test_watching_several_runs_says_how_each_one_that_left_ended(tmp_path: Path) -> None:
    from unicron.status.client import Target
    from unicron.status.watch import RunsPoller, run_watch

    failed_dir, killed_dir = tmp_path / "failed", tmp_path / "killed"
    log = EventLog(failed_dir / "events.jsonl", job="bad", node="n")
    log.emit("job_end", exit_code=1, reason="exception on rank 0 at step 60: ValueError: boom")
    log.close()
    killed_dir.mkdir()  # its launcher was SIGKILLed: no job_end in its log
    good = Target("good", "127.0.0.1:1", b"k", 11, 1.0, str(tmp_path))
    bad = Target("bad", "127.0.0.1:2", b"k", 12, 1.0, str(failed_dir))
    killed = Target("killed", "127.0.0.1:3", b"k", 13, 1.0, str(killed_dir))
    listed = [[good, bad, killed], [good, killed], [good], [good], []]
    polls = iter(listed)
    poller = RunsPoller(1.0, clock=lambda: 100.0, targets=lambda: next(polls),
                        poll=lambda targets, _t: [(t.info(), snapshot_with("running"), "") for t in targets])
    out = io.StringIO()
    ended = run_watch(Console(file=out, width=200), poller, 0.0, wait=lambda _s: None)
    text = out.getvalue() + ended
    assert "bad: ended (failed, exit 1: exception on rank 0 at step 60: ValueError: boom)" in text, text
    assert "killed: ended (its coordinator is gone; last state: running)" in text, text
    assert "good: ended (its coordinator is gone; last state: running)" in ended  # the last one, at the end
    assert ended.endswith("every unicron run on this machine ended")


TRACEBACK = ("Traceback (most recent call last):\n  File \"/srv/train/train_gpt.py\", line 212, in <module>\n"
             "    loss = step(model, batch)\nValueError: boom at step 60 after a very long run of the data loader")


@pytest.mark.timeout(60)
def test_watch_into_a_file_ends_with_one_unwrapped_line(runs_dir: Path, coordinator) -> None:
    """Acceptance 29C F5: `status --watch > file` ended with a job's multi-line traceback, wrapped
    at 80 columns; docs/status.md promises one line per change."""
    ended = snapshot_with("failed", 1)
    ended["job"].update(reason=f"exception on rank 0: {TRACEBACK}", exit_code=1)
    script = [snapshot_with("running"), ended]
    c = coordinator(lambda n: script[min(n, len(script) - 1)])
    code, out = invoke(["status", "-e", c.endpoint, "-j", JOB, "--watch", "--interval", "0.05", "--timeout", "5"],
                       env={"UNICRON_SECRET": KEY.decode(), "COLUMNS": "80"})
    assert code == 0
    flat = " ".join(TRACEBACK.split())
    assert out.splitlines()[-1] == f"run gpt-demo ended (failed, exit 1: exception on rank 0: {flat})", out
    assert len(out.splitlines()[-1]) > 80 and out.startswith("gpt-demo running") and out.count("\n") == 2, out


@pytest.mark.timeout(60)
def test_watching_runs_into_a_file_is_one_line_per_change(tmp_path: Path) -> None:
    from unicron.status.watch import RunsPoller

    failed_dir = tmp_path / "failed"
    log = EventLog(failed_dir / "events.jsonl", job="bad", node="n")
    log.emit("job_end", exit_code=1, reason=f"exception on rank 0: {TRACEBACK}")
    log.close()
    good = Target("good", "127.0.0.1:1", b"k", 11, 1.0, str(tmp_path))
    bad = Target("bad", "127.0.0.1:2", b"k", 12, 1.0, str(failed_dir))
    polls = iter([[good, bad], [good], []])
    poller = RunsPoller(1.0, clock=lambda: 100.0, targets=lambda: next(polls),
                        poll=lambda targets, _t: [(t.info(), snapshot_with("running"), "") for t in targets])
    out = io.StringIO()
    ended = run_watch(Console(file=out, width=80), poller, 0.0, wait=lambda _s: None)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("good: gpt-demo running"), lines  # one per change
    assert f"bad: ended (failed, exit 1: exception on rank 0: {' '.join(TRACEBACK.split())})" in lines[1]
    assert "\n" not in ended and ended.endswith("; every unicron run on this machine ended")


def test_a_runs_end_is_read_only_from_since_it_started(tmp_path: Path) -> None:
    # A standalone coordinator appends to one log per job id: a job id used again keeps the
    # earlier run's job_end, which is not how this run ended.
    from unicron.status.client import Target

    log = EventLog(tmp_path / "events.jsonl", job="x", node="n")
    log.emit("job_end", exit_code=0, reason="all workers finished successfully")
    log.close()
    assert Target("x", "127.0.0.1:1", b"k", 1, time.time() + 60, str(tmp_path)).final_event() is None
    assert Target("x", "127.0.0.1:1", b"k", 1, time.time() - 60, str(tmp_path)).final_event()["exit_code"] == 0


def test_the_one_run_left_whose_secret_is_unreadable_is_a_row_when_watching_runs(runs_dir: Path,
                                                                                 tmp_path: Path) -> None:
    from unicron.status.client import resolve_targets

    register_run(RunInfo(job="gone-dir", endpoint="127.0.0.1:1", pid=os.getpid(),
                         secret_file=str(tmp_path / "deleted" / "secret"), log_dir=str(tmp_path / "deleted"),
                         started_at=time.time()))
    with pytest.raises(UnicronError):
        resolve_targets(None, None, None)  # asked for alone: the error itself
    [row] = resolve_targets(None, None, None, as_rows=True)
    assert row.job == "gone-dir" and row.error.startswith("secret unreadable")


def test_watching_a_local_run_that_does_not_answer_yet_waits_for_it(runs_dir: Path, tmp_path: Path,
                                                                      coordinator) -> None:
    # A run on this machine whose process lives but whose coordinator is slow to answer its first
    # poll (starting on a loaded machine) is waited for; only an endpoint never reached is an error.
    script = [None, None, snapshot_with("running"), snapshot_with("done")]
    c = coordinator(lambda n: script[min(n, len(script) - 1)])
    register_local(tmp_path, c.endpoint, os.getpid())
    code, out = invoke(["status", "--watch", "--interval", "0.05", "--timeout", "0.3"])
    assert code == 0 and out.splitlines()[-1] == "run gpt-demo ended (done)", out
    assert out.startswith(f"waiting for {c.endpoint}… (no answer for"), out


def test_a_fifo_or_dev_zero_among_the_run_entries_is_skipped_not_read(tmp_path: Path, runs_dir: Path) -> None:
    """Acceptance 27C F7: a FIFO named *.json in the runs directory hung `unicron status`, and
    a link to /dev/zero filled memory; each is skipped, and the real run is still found."""
    from unicron.runs import list_runs

    register_local(tmp_path, "127.0.0.1:1001", os.getpid())
    os.mkfifo(runs_dir / "fifo.json")
    (runs_dir / "zero.json").symlink_to("/dev/zero")
    (runs_dir / "big.json").write_bytes(b" " * (1 << 20))
    assert [r.endpoint for r in list_runs() if r.job == JOB] == ["127.0.0.1:1001"]


def test_a_job_id_no_run_can_have_is_a_usage_error(runs_dir: Path) -> None:
    """Acceptance 27C F13: --job a/b exited 5, the code of an endpoint that did not answer."""
    assert invoke(["status", "--job", "a/b"]) == (2, "--job: must be letters, digits and . _ : @ + - only; got 'a/b'")
