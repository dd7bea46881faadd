"""`unicron coordinator`: a standalone coordinator serving several jobs."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import typer

from unicron.errors import ConfigError, UsageError


def register(app: typer.Typer) -> None:
    @app.command("coordinator")
    def coordinator(
        port: int = typer.Option(29400, "--port", help="TCP port to listen on (0: any free port)."),
        host: str = typer.Option("*", "--host", help="Address to bind (* for all interfaces)."),
        secret_file: str = typer.Option("", "--secret-file", help="File holding the shared HMAC secret "
                                        "(else $UNICRON_SECRET)."),
        log_dir: str = typer.Option("", "--log-dir", help="Where each job's events.jsonl goes "
                                    "(default: a temporary directory)."),
        metrics_port: int = typer.Option(-1, "--metrics-port", help="Serve Prometheus metrics on this port "
                                         "(0: any free port; default: off)."),
        end_jobs_on_exit: bool = typer.Option(False, "--end-jobs-on-exit", help="On SIGINT/SIGTERM, end every "
                                              "job it serves (their nodes exit 1) instead of leaving them to "
                                              "train on until a coordinator is started again on the port."),
    ) -> int:
        """Serve the jobs whose agents join with `unicron run --coordinator HOST:PORT`."""
        from unicron.agent.ui import AgentUI
        from unicron.coord.decide import DetectDecider
        from unicron.coord.server import CoordinatorServer
        from unicron.events import EVENTS_FILE, EventLog
        from unicron.runs import RunInfo, register_run_or_warn, unregister_run, write_secret_file

        if not 0 <= port <= 65535:
            raise UsageError(f"--port: {port} is not a TCP port")
        if not -1 <= metrics_port <= 65535:
            raise UsageError(f"--metrics-port: {metrics_port} is not a TCP port")
        if log_dir and os.path.exists(log_dir) and not os.path.isdir(log_dir):
            raise UsageError(f"--log-dir: {log_dir} is a file, not a directory")
        secret = _secret(secret_file)
        base = Path(log_dir) if log_dir else Path(os.environ.get("TMPDIR", "/tmp")) / f"unicron-coordinator-{os.getpid()}"
        logs: dict[str, EventLog] = {}
        registered: list[str] = []

        def events_for(job: str) -> EventLog:
            if job not in logs:
                safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
                logs[job] = EventLog(base / safe / EVENTS_FILE, job=job, node=socket.gethostname())
                # Its decisions on this console (no agent's console shows them: none hosts it).
                console = AgentUI("never", name="unicron coordinator", label=f"job {job!r}: ")
                logs[job].listeners.append(console.on_event)
                sfile = secret_file or write_secret_file(base, secret, console.warn)
                register_run_or_warn(RunInfo(job=job, endpoint=f"{_shown(host)}:{server.port}", pid=os.getpid(),
                                             secret_file=sfile, log_dir=str(base / safe), started_at=time.time()),
                                     console.warn)
                registered.append(job)
            return logs[job]

        import zmq

        try:
            server = CoordinatorServer(secret, bind_host=host, port=port, events_for=events_for,
                                       decider_for=DetectDecider, jobs=None,
                                       warn=lambda line: typer.echo(f"unicron coordinator: {line}", err=True))
        except zmq.ZMQError as err:
            raise UsageError(f"cannot listen on {host}:{port}: {err.strerror}") from None
        stop = threading.Event()
        got: list[int] = []

        def on_signal(signum: int, _frame: object) -> None:
            got.append(signum)
            stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        server.start()
        metrics = None
        if metrics_port >= 0:  # before "listening" is said: its port may be taken (one error line, then)
            from unicron.status.metrics import start_metrics_server

            metrics, mport = start_metrics_server(metrics_port, server.metrics)
        typer.echo(f"unicron coordinator listening on {_listening(host, server.port)}", err=True)
        if metrics is not None:
            typer.echo(f"metrics on {_listening(host, mport, 'http://', '/metrics')}", err=True)
        try:
            while not stop.wait(0.2):
                if server.thread is not None and not server.thread.is_alive():
                    break
        finally:
            if metrics is not None:
                metrics.stop()
            how = f"stopped by {signal.Signals(got[0]).name}" if got else "stopped"
            # Stopped on purpose (an upgrade, a restart by systemd, Ctrl-C): its jobs train on, as
            # after a crash, and a coordinator started again on the port takes them back.
            leave = bool(got) and not end_jobs_on_exit
            server.stop(reason=f"the coordinator was {how}", end_jobs=not leave)
            left = server.unfinished_jobs() if leave else []
            ended = server.ended_on_stop
            if got and ended:
                typer.echo(f"unicron coordinator: {how}; {len(ended)} job(s) ended ({', '.join(ended)}): their "
                           "nodes exit 1 (--end-jobs-on-exit)", err=True)
            if left:
                typer.echo(f"unicron coordinator: {how}; {len(left)} job(s) left to a successor "
                           f"({', '.join(left)}): start it again on port {server.port} to take them back "
                           "(--end-jobs-on-exit ends them instead)", err=True)
            if got and not ended and not left:  # said on every way out (29C: a quiet exit 0 read as a crash)
                typer.echo(f"unicron coordinator: {how}; no job was running", err=True)
            for job in registered:
                unregister_run(job)
            for log in logs.values():
                log.close()
        return 0


def _secret(secret_file: str) -> bytes:
    from unicron.runs import secret_from_file

    if secret_file:
        try:
            secret = secret_from_file(secret_file)
        except ConfigError as err:
            raise ConfigError(f"--secret-file: {err}") from None
    else:
        secret = os.environ.get("UNICRON_SECRET", "").encode()
    if not secret:
        raise ConfigError("no job secret: set UNICRON_SECRET or pass --secret-file (the agents need the same one)")
    return secret


def _shown(host: str) -> str:
    """Where a client on this host reaches it (the runs registry)."""
    return "127.0.0.1" if host in ("*", "0.0.0.0", "") else host


def _listening(host: str, port: int, scheme: str = "", path: str = "") -> str:
    """Where it listens, as its operator needs it: every interface is not 127.0.0.1 only."""
    if host in ("*", "0.0.0.0", ""):
        name = socket.gethostname()
        return f"every interface, port {port} (nodes reach it at {scheme}{name}:{port}{path})"
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address, as HOST:PORT takes it (27C F13)
    return f"{scheme}{shown}:{port}{path}"
