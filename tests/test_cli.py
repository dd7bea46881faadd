"""The `unicron` command itself: version, help, and one clear line for every kind of misuse."""

from __future__ import annotations

import subprocess
import sys

import pytest
from e2e import clean_env, unicron_cmd


def _run(*args: str, timeout: float = 60, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(unicron_cmd(*args), capture_output=True, text=True, timeout=timeout,
                          env=clean_env(**(env_extra or {})))


def test_version_and_help() -> None:
    assert _run("--version").stdout.strip() == "unicron 0.1.0"
    out = _run("--help").stdout
    for command in ("run", "coordinator", "plan", "simulate", "status", "events"):
        assert command in out
    assert "--nproc-per-node" in _run("run", "--help").stdout
    # -h, as torchrun takes it, on every command
    assert "coordinator" in _run("-h").stdout
    for command in ("run", "coordinator", "plan", "simulate", "status", "events"):
        proc = _run(command, "-h")
        assert proc.returncode == 0 and f"unicron {command}" in proc.stdout, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["bogus"], "No such command"),
    (["plan"], "Missing option"),
    (["status", "--bogus"], "No such option"),
    (["run", "--nnodes", "3:2", "x.py"], "--nnodes"),
    (["run", "--bogus-flag", "x.py"], "--bogus-flag"),
    (["coordinator", "--port", "70000"], "port"),
    (["coordinator", "--port", "0", "--log-dir", "/etc/passwd"], "--log-dir: /etc/passwd is a file"),
    (["coordinator", "--port", "0", "--metrics-port", "70000"], "--metrics-port: 70000 is not a TCP port"),
    (["coordinator", "--port", "0", "--secret-file", "/dev/zero"], "/dev/zero: it is not a regular file"),
    (["coordinator", "--port", "0", "--secret-file", "/dev/null"], "it is not a regular file"),
    (["status", "--endpoint", "127.0.0.1:1", "--job", "j", "--secret-file", "/dev/zero"], "not a regular file"),
    ([], "missing command"),
])
def test_misuse_is_one_line_and_nonzero(args, message) -> None:
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unicron: error:") and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_coordinator_without_secret_is_refused() -> None:
    proc = _run("coordinator", "--port", "0")
    assert proc.returncode == 2 and "UNICRON_SECRET" in proc.stderr


# Ctrl-C lands while the console script is still importing the CLI (typer, rich, networkx:
# most of a second): the signal is sent from inside the import of typer, so it always does.
_CTRL_C_DURING_IMPORT = """
import builtins, os, signal, sys
# As at a terminal (DISPOSITION default_int_handler) or as a shell's background job, which starts
# with SIGINT ignored (SIG_IGN): a test run in the background inherits it so.
signal.signal(signal.SIGINT, signal.DISPOSITION)
real_import = builtins.__import__
def ctrl_c_at_typer(name, *args, **kwargs):
    if name == "typer":
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)
builtins.__import__ = ctrl_c_at_typer
sys.argv = ["unicron", "--version"]
from unicron.console import entrypoint
entrypoint()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("disposition", ["default_int_handler", "SIG_IGN"])
def test_ctrl_c_while_importing_is_one_line(disposition: str) -> None:
    """Also when SIGINT came ignored (31B F1: ``unicron run ... & kill -INT $!`` was dropped in the
    first 0.3 s, while the same signal a moment later stopped the job, as it does torchrun's)."""
    proc = subprocess.run([sys.executable, "-c", _CTRL_C_DURING_IMPORT.replace("DISPOSITION", disposition)],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr == "unicron: error: interrupted by SIGINT\n", proc.stderr
    assert proc.stdout == ""


def test_a_coordinators_metrics_port_in_use_is_one_line_and_nothing_said_listening() -> None:
    """Acceptance 25C F5: "listening on ..." came before the error line."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        proc = _run("coordinator", "--port", "0", "--metrics-port", str(taken.getsockname()[1]),
                    env_extra={"UNICRON_SECRET": "s"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unicron: error: --metrics-port"), proc.stderr


def test_a_coordinators_empty_secret_file_is_named_as_empty(tmp_path) -> None:
    empty = tmp_path / "secret"
    empty.write_text("\n")
    proc = _run("coordinator", "--port", "0", "--secret-file", str(empty))
    assert proc.returncode == 2 and f"--secret-file: secret file {empty} is empty" in proc.stderr, proc.stderr


@pytest.mark.parametrize("closed", ["2>&-", ">&-"])
def test_a_launcher_started_with_a_standard_stream_closed_runs_its_job(tmp_path, closed: str) -> None:
    """Acceptance 19C F8: with stderr closed (`2>&-`, some daemonizers and cron wrappers) the
    launcher exited 1 at once, silently (its first line met ``sys.stderr`` None); with stdout
    closed the zygote died in a traceback and every worker started cold. torchrun runs both."""
    import shlex

    script = tmp_path / "t.py"
    script.write_text("import sys\nopen(sys.argv[1], 'w').write('ran')\nprint('to stdout')\n")
    marker = tmp_path / "ran"
    cmd = " ".join(shlex.quote(a) for a in unicron_cmd("run", "--standalone", "--nproc-per-node", "1",
                                                      "--log-dir", str(tmp_path / "logs"), str(script), str(marker)))
    # The stream not closed goes to a file, so the test sees what was said there.
    rest = ">out.txt" if closed == "2>&-" else "2>err.txt"
    proc = subprocess.run(["sh", "-c", f"exec {closed} {rest}; exec {cmd}"], cwd=tmp_path, env=clean_env(), timeout=120)
    assert proc.returncode == 0, (tmp_path / "err.txt").read_text() if (tmp_path / "err.txt").exists() else ""
    assert marker.read_text() == "ran"
    if closed == ">&-":
        assert "Traceback" not in (tmp_path / "err.txt").read_text()
        events = next((tmp_path / "logs").rglob("events.jsonl")).read_text()
        assert '"warm":1' in events, "the worker started cold"


@pytest.mark.timeout(60)
def test_a_coordinator_stopped_with_no_job_says_so(tmp_path) -> None:
    """Stopped by SIGINT or SIGTERM with no job, it said nothing at all and exited 0 (29C)."""
    import signal

    from e2e import wait_for

    proc = subprocess.Popen(unicron_cmd("coordinator", "--port", "0", "--log-dir", str(tmp_path)),
                            stderr=subprocess.PIPE, text=True, env=clean_env(UNICRON_SECRET="s"))
    try:
        assert proc.stderr is not None
        wait_for(lambda: "listening on" in proc.stderr.readline(), 30, "the coordinator to listen")
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
    assert rest.strip() == "unicron coordinator: stopped by SIGTERM; no job was running", rest
