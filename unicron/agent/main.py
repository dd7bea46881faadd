"""`unicron run` on one node: host the coordinator if this node owns the endpoint, then run
the agent until the job ends. Everything started here is stopped here, on every path."""

from __future__ import annotations

import ipaddress
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq

from unicron.agent import errorfile
from unicron.agent.agent import Agent
from unicron.agent.fdlimit import ensure_fd_limit
from unicron.agent.joining import join_body
from unicron.agent.logs import RunLogDir
from unicron.agent.settings import AgentSettings
from unicron.agent.signals import LauncherSignals, set_child_subreaper
from unicron.agent.ui import AgentUI
from unicron.coord.decide import DetectDecider
from unicron.coord.server import CoordinatorServer
from unicron.coord.stores import preload as preload_store
from unicron.errors import UnicronError, UsageError, WorkerFailedError
from unicron.events import EVENTS_FILE, EventLog
from unicron.runs import RunInfo, register_run_or_warn, unregister_run, write_secret_file

# How long to keep trying to host the coordinator while its port is taken but nobody listens.
_HOST_RACE_S = 2.0


def run_job(cfg: Any) -> int:
    """Entry point of `unicron run` (``cfg`` is the resolved LaunchConfig)."""
    from unicron.launch.bridge import settings_from_config
    from unicron.launch.workerenv import AGENT_OWNED_VARS

    # cfg holds all the launcher needed from its environment. What it inherited of the job
    # secret and of the workers' own variables must reach no child: a zygote's environment is
    # every warm worker's /proc/PID/environ, and a worker would take a user's UNICRON_INJECT
    # as this attempt's (every attempt's) faults.
    for name in AGENT_OWNED_VARS:
        os.environ.pop(name, None)
    return run_agent(settings_from_config(cfg))


def run_agent(s: AgentSettings) -> int:
    set_child_subreaper(True)  # orphaned grandchildren of workers come to us, so we can reap them
    fd_warning = ensure_fd_limit(s.nproc)  # before anything opens: a few hundred ranks outgrow 1024
    run_logs = RunLogDir(s.log_spec, s.run_id)
    events_dir = run_logs.run_dir or tempfile.mkdtemp(prefix="unicron_events_")
    events = EventLog(os.path.join(events_dir, EVENTS_FILE), job=s.run_id, node=socket.gethostname())
    ui = AgentUI(s.status_line, workers_off_console=s.log_spec.keeps_workers_off_console)
    ui.job = {"id": s.run_id, "max_restarts": s.max_restarts, "started_at": time.time()}
    server: CoordinatorServer | None = None
    agent: Agent | None = None
    launcher_error_file = os.environ.get(errorfile.ENV) or None  # a wrapper's (TorchX): see errorfile
    stopped_by, stopped_code = "", 1
    metrics: Any = None
    secret_file: str | None = None
    for warning in [*s.warnings, fd_warning] if fd_warning else s.warnings:
        ui.warn(warning)
    with LauncherSignals(s.signals) as signals:
        # Once this launcher is interrupted, what the embedded coordinator decides about this
        # node leaving (a restart or a stop for the other nodes) is not news to the user who
        # interrupted it: the log keeps it, the console shows the interruption.
        events.listeners.append(lambda event: None if signals.signum is not None else ui.on_event(event))
        try:
            server, endpoint = _coordinator(s, events, ui.warn)
            if server is not None:
                secret_file = s.secret_file or write_secret_file(events_dir, s.secret, ui.warn)
                # This node's own flags define the job, not those of whichever node joins first.
                server.job_settings[s.run_id] = join_body(s, "", _display_host(s), os.getpid(), {})
                # With warm workers, the zygote's store host serves the stores (given below).
                server.start(preload_store=not s.warm)
                # Registered once it serves: `unicron status` finds no run it cannot ask yet.
                register_run_or_warn(RunInfo(job=s.run_id, endpoint=f"{_display_host(s)}:{server.port}",
                                             pid=os.getpid(), secret_file=secret_file, log_dir=events_dir,
                                             started_at=time.time()), ui.warn)
                ui.info(f"coordinator for job {s.run_id} on port {server.port}; events in {events.path}")
                if s.metrics_port is not None:
                    from unicron.status.metrics import start_metrics_server

                    metrics, mport = start_metrics_server(s.metrics_port, server.metrics)
                    ui.info(f"metrics on http://{_display_host(s)}:{mport}/metrics")
            elif (unresolved := _unresolved(endpoint)) is not None:  # a typo would look like a silent coordinator
                ui.warn(f"the rendezvous host {unresolved} does not resolve (yet); still trying for up to "
                        f"{s.join_timeout_s:g} s")
            events.emit("agent_start", endpoint=endpoint, nproc=s.nproc, pid=os.getpid(),
                        coordinator=server is not None)
            agent = Agent(s, endpoint=endpoint, run_logs=run_logs, events=events, ui=ui, signals=signals,
                          hosts_coordinator=server is not None)
            if server is not None:
                server.pinned.add(agent.node_id)  # a reconfigure must not end the coordinator's own agent
                channel = agent.pool.store_channel if agent.pool is not None else None
                if channel is not None:
                    server.stores.host = channel
                elif s.warm:  # no zygote after all (a custom python): torch for the stores, ahead of time
                    preload_store()
                # The stores stay open until the workers are stopped (the ``stop`` below).
                agent.end_own_job = lambda why, code: server.stop(
                    reason=f"the coordinator's node stopped: {why}", exit_code=code, keep_stores=True)
            code = agent.run()
            if agent.output_left_behind:  # kept: the only copy of what the console did not take
                ui.warn(f"the console took nothing for 10 s: the rest of the workers' output is in "
                        f"{run_logs.run_dir or run_logs.root}")
            elif code == 0:
                run_logs.discard_worker_logs()  # the temporary copies of a job that succeeded
            return code
        except BaseException as err:
            stopped_by = str(err) or type(err).__name__
            stopped_code = getattr(err, "exit_code", 1)
            if launcher_error_file and isinstance(err, WorkerFailedError):
                _record_failure(launcher_error_file, err, run_logs, agent, ui)
            elif launcher_error_file and isinstance(err, UnicronError) and not isinstance(err, UsageError):
                # As torchrun's @record'ed main writes any exception that leaves it: a SIGTERM
                # (preemption, eviction), a rendezvous timeout, a lost coordinator.
                problem = errorfile.write(launcher_error_file, errorfile.record(
                    (str(err) or type(err).__name__).splitlines()[0], stopped_code, None))
                if problem is not None:
                    ui.warn(problem)
            raise
        finally:
            if metrics is not None:
                metrics.stop()
            if server is not None:
                # A job that ended was told to every node already; one still going (this launcher
                # interrupted or failing) is ended for the other nodes now, not after their wait
                # for a silent coordinator.
                server.stop(reason=f"the coordinator's node stopped: {stopped_by}" if stopped_by
                            else "the coordinator's node stopped", exit_code=stopped_code)
                unregister_run(s.run_id)
            ui.close()
            events.close()


def _record_failure(path: str, err: WorkerFailedError, run_logs: RunLogDir, agent: Agent | None, ui: AgentUI) -> None:
    """The launcher's ``TORCHELASTIC_ERROR_FILE``, as torchrun's ``@record`` writes it."""
    assignment = agent.assignment if agent is not None else None
    offset = assignment.get("rank_offset", 0) if isinstance(assignment, dict) else 0
    source = errorfile.root_cause_file(str(err), run_logs, agent.last_attempt if agent else None, offset)
    problem = errorfile.write(path, errorfile.record(str(err).splitlines()[0], err.exit_code, source))
    if problem is not None:
        ui.warn(problem)


def _coordinator(s: AgentSettings, events: EventLog,
                 warn: Callable[[str], None]) -> tuple[CoordinatorServer | None, str]:
    """Host the coordinator here if this node owns the endpoint; return it and where to join."""
    if s.coordinator:
        return None, _tcp(s.coordinator)
    if not s.embed_coordinator or s.is_host is False or (s.is_host is None and not _is_local(s.rdzv_host)):
        if s.secret_generated:  # a drawn secret matches no coordinator but this node's own
            where = ("--rdzv-conf is_host=0" if s.is_host is False
                     else f"the rendezvous endpoint {s.rdzv_host} is not this machine")
            raise UsageError(f"this node joins a coordinator elsewhere ({where}), so the job needs the same "
                             "secret on every node: set UNICRON_SECRET or pass --secret-file PATH")
        return None, _tcp(f"{s.rdzv_host}:{s.rdzv_port}")
    host = _display_host(s)
    # Told to host, or the job's only node: another listener is another job (or any process),
    # not this job's coordinator; torchrun fails on the port in use too.
    must_host = bool(s.is_host) or s.max_nodes == 1
    deadline = time.monotonic() + _HOST_RACE_S
    while True:
        try:
            server = CoordinatorServer(s.secret, bind_host="*", port=s.rdzv_port, events_for=lambda _job: events,
                                       decider_for=DetectDecider, jobs={s.run_id}, exit_when_done=True,
                                       advertise_addr=s.advertise_addr, warn=warn)
            return server, _tcp(f"{host}:{server.port}")
        except zmq.ZMQError as err:
            if err.errno != zmq.EADDRINUSE or s.rdzv_port == 0:
                raise UsageError(f"cannot listen on port {s.rdzv_port}: {err.strerror}") from None
        # EADDRINUSE alone does not prove another agent hosts it: two agents started at the same
        # instant can both lose, because with SO_REUSEADDR Linux lets both bind and then fails
        # both listen() calls. Only a listener is proof; without one, try again shortly.
        if must_host and time.monotonic() > deadline:
            why = "--rdzv-conf is_host=1" if s.is_host else "a one-node job hosts its own rendezvous"
            raise UsageError(f"{why}: cannot listen on port {s.rdzv_port}: another process listens there "
                             "(another job?); pick a free port")
        if not must_host and (_listening(host, s.rdzv_port) or time.monotonic() > deadline):
            return None, _tcp(f"{s.rdzv_host}:{s.rdzv_port}")
        time.sleep(random.uniform(0.005, 0.05))


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=1.0):
            return True
    except OSError:
        return False


def _tcp(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return f"tcp://{host}:{port}" if ":" not in host else f"tcp://[{host}]:{port}"


def _unresolved(endpoint: str) -> str | None:
    """The host of ``tcp://HOST:PORT`` if it is a name that does not resolve, else None."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host.partition("%")[0])
        return None  # an address: nothing to resolve
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return host
    return None


def _display_host(s: AgentSettings) -> str:
    return "127.0.0.1" if s.rdzv_host in ("", "localhost", "0.0.0.0") else s.rdzv_host


def _is_local(host: str) -> bool:
    if host in ("", "localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        import psutil

        addrs = {a.address.split("%")[0] for ifs in psutil.net_if_addrs().values() for a in ifs}
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return any(info[4][0] in addrs for info in infos)
