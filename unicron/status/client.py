"""Find the coordinators to ask, ask them for a status snapshot, and follow one over time.

``Target`` names one job on one coordinator with its secret. ``WatchState`` is the pure
memory of a ``--watch`` session: the last good snapshot, since when the coordinator has not
answered, and whether the run has ended.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from unicron import runs
from unicron.errors import ConfigError, EndpointUnreachableError, UsageError
from unicron.events import EVENTS_FILE, read_events
from unicron.launch.values import to_rdzv_id
from unicron.proto.client import request, tcp_endpoint

ENDED_STATES = frozenset({"done", "failed"})
SECRET_ENV = "UNICRON_SECRET"
NO_RUN_MESSAGE = "no unicron run found on this machine (start one with `unicron run`, or pass --endpoint HOST:PORT)"


@dataclass(frozen=True)
class Target:
    """One job on one coordinator. ``pid`` is set for runs found on this machine."""

    job: str
    endpoint: str
    key: bytes = field(repr=False)
    pid: int | None = None
    started_at: float = 0.0
    log_dir: str = ""
    error: str = ""  # why it cannot be asked (one run of several whose secret is unreadable)

    def info(self) -> dict[str, Any]:
        return {"job": self.job, "endpoint": self.endpoint, "pid": self.pid, "started_at": self.started_at,
                "log_dir": self.log_dir}

    def gone(self) -> bool:
        """True when we know the run is over: its coordinator process or registry entry is gone.

        A remote endpoint cannot be checked, so it is never known to be gone.
        """
        if self.pid is None:
            return False
        if not psutil.pid_exists(self.pid):
            return True
        return not any(r.job == self.job and r.pid == self.pid for r in runs.list_runs())


    def final_event(self) -> dict[str, Any] | None:
        """The run's ``job_end`` event from its event log (how it ended), if there is one. Only
        one from since the run started: a standalone coordinator appends to one log per job id,
        and a job id used again keeps the earlier run's end in it."""
        if not self.log_dir:
            return None
        path = Path(self.log_dir) / EVENTS_FILE
        try:
            ends = list(read_events(path, kinds={"job_end"}, since=self.started_at or None))
        except OSError:
            return None
        return ends[-1] if ends else None


def fetch_snapshot(target: Target, timeout_s: float) -> dict[str, Any]:
    """Ask ``target`` for its status snapshot; EndpointUnreachableError within ``timeout_s``."""
    try:
        msg = request(target.endpoint, "status_req", {}, job=target.job, key=target.key,
                      timeout_s=timeout_s, expect="status")
    except EndpointUnreachableError as err:
        if str(err).startswith("no answer"):
            if target.pid is not None and _stopped(target.pid):  # a local run frozen (acceptance 25C F5)
                raise EndpointUnreachableError(f"{err}: its process {target.pid} is stopped (SIGSTOP, Ctrl-Z?); "
                                               "it answers once continued (kill -CONT)") from None
            # A coordinator silently drops what it cannot verify, so say what else it could be.
            raise EndpointUnreachableError(f"{err} (is it running, and are --job and the secret right?)") from None
        raise
    snapshot = msg.body.get("snapshot")
    if not isinstance(snapshot, dict):
        raise EndpointUnreachableError(f"bad answer from {target.endpoint}: no snapshot")
    return snapshot


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


RunRow = tuple[dict[str, Any], dict[str, Any] | None, str]


def poll_targets(targets: list[Target], timeout_s: float) -> list[RunRow]:
    """(run info, snapshot or None, error) for each target, asked one after another."""
    rows: list[RunRow] = []
    for target in targets:
        if target.error:
            rows.append((target.info(), None, target.error))
            continue
        try:
            rows.append((target.info(), fetch_snapshot(target, timeout_s), ""))
        except EndpointUnreachableError:
            rows.append((target.info(), None, "no answer"))
    return rows


def _secret(secret_file: str | None, env: Mapping[str, str]) -> bytes | None:
    if secret_file:
        return runs.secret_from_file(secret_file)
    value = env.get(SECRET_ENV, "").strip()
    return value.encode() if value else None


def _local_target(info: runs.RunInfo, *, one_of_several: bool = False) -> Target:
    """``one_of_several``: a run whose secret cannot be read is a row saying so, not an error
    that would hide every other run."""
    try:
        key = runs.read_secret(info.secret_file)
    except OSError as err:
        if one_of_several:
            return Target(info.job, info.endpoint, b"", info.pid, info.started_at, info.log_dir,
                          error=f"secret unreadable: {err.strerror or err}")
        raise ConfigError(f"run {info.job}: cannot read its secret file {info.secret_file}: "
                          f"{err.strerror or err}") from None
    return Target(info.job, info.endpoint, key, info.pid, info.started_at, info.log_dir)


def _same_endpoint(a: str, b: str) -> bool:
    """Whether two HOST:PORT name the same endpoint on this machine: the registry keeps the
    address a run listens on, a user may write this machine's name (as the status view shows it)."""
    def norm(ep: str) -> str:
        ep = ep.removeprefix("tcp://")
        host, _, port = ep.rpartition(":")
        local = host in ("localhost", "0.0.0.0", "::", "[::]", "", socket.gethostname()) or host.startswith("127.")
        return f"{'127.0.0.1' if local else host}:{port}"

    return norm(a) == norm(b)


def resolve_targets(endpoint: str | None, job: str | None, secret_file: str | None,
                    env: Mapping[str, str] | None = None, *, as_rows: bool = False) -> list[Target]:
    """The jobs `unicron status` should show.

    With ``endpoint``: one target; the secret comes from ``secret_file``, else UNICRON_SECRET,
    else a run on this machine with that endpoint (which also supplies the job id).
    Without: every run registered on this machine (only ``job`` when given).
    """
    env = os.environ if env is None else env
    if job is not None:
        try:  # no run can have it (exit 2, not 5: nothing was tried to reach; 27C F13)
            to_rdzv_id(job)
        except ValueError as err:
            raise UsageError(f"--job: {err}") from None
    if endpoint is None:
        found = [r for r in runs.list_runs() if job is None or r.job == job]
        if not found:
            raise EndpointUnreachableError(f"no unicron run of job {job!r} found on this machine" if job
                                           else NO_RUN_MESSAGE)
        return [_local_target(r, one_of_several=as_rows or len(found) > 1) for r in found]
    tcp_endpoint(endpoint)  # a malformed endpoint is the first thing to say
    key = _secret(secret_file, env)
    local = [r for r in runs.list_runs() if _same_endpoint(r.endpoint, endpoint) and (job is None or r.job == job)]
    if key is None or job is None:
        if len(local) == 1:
            known = _local_target(local[0])
            return [Target(job or known.job, endpoint, key or known.key, known.pid, known.started_at, known.log_dir)]
        if job is None:
            raise UsageError("--job ID is required with --endpoint (the coordinator may serve several jobs)")
        there = sorted({r.job for r in runs.list_runs() if _same_endpoint(r.endpoint, endpoint)})
        if there and not local:  # the job id is what is wrong, not a missing secret (29C F6)
            raise UsageError(f"no unicron run known here serves job {job!r} at {endpoint} (it serves "
                             f"{', '.join(repr(j) for j in there)}; or set {SECRET_ENV} to ask it anyway)")
        raise UsageError(f"no secret for {endpoint}: set {SECRET_ENV} or pass --secret-file PATH")
    return [Target(job, endpoint, key)]


@dataclass
class WatchState:
    """What a ``--watch`` session knows, updated with every poll (pure: time is an argument)."""

    snapshot: dict[str, Any] | None = None
    last_ok_at: float | None = None
    failing_since: float | None = None
    error: str = ""
    ended: str = ""  # why the watch is over ("" while it goes on)

    def on_snapshot(self, snapshot: dict[str, Any], now: float) -> None:
        self.snapshot, self.last_ok_at, self.failing_since, self.error = snapshot, now, None, ""
        state = job_state(snapshot)
        if state in ENDED_STATES:
            job = snapshot.get("job") if isinstance(snapshot.get("job"), dict) else {}
            reason = f": {job['reason']}" if isinstance(job, dict) and job.get("reason") else ""
            code = job.get("exit_code") if isinstance(job, dict) else None
            exit_text = f", exit {code}" if isinstance(code, int) and not isinstance(code, bool) else ""
            # Same words as when the end is read from the event log after the run is gone.
            self.ended = f"run {_job_id(snapshot)} ended ({state}{exit_text}{reason})"

    def on_error(self, error: str, now: float, *, run_gone: bool, job_end: Mapping[str, Any] | None = None) -> None:
        """The coordinator did not answer. ``run_gone``: we know its process is gone;
        ``job_end``: the run's final event from its log, if it wrote one."""
        if self.failing_since is None:
            self.failing_since = now
        self.error = error
        if not run_gone:
            return
        who = f"run {_job_id(self.snapshot)}" if self.snapshot else "the run"
        if job_end is not None:
            self.ended = f"{who} ended ({how_it_ended(job_end)})"
        else:
            self.ended = f"{who} ended (its coordinator is gone; last state: {job_state(self.snapshot)})"

    @property
    def reconnecting(self) -> bool:
        return self.failing_since is not None and not self.ended


def how_it_ended(job_end: Mapping[str, Any]) -> str:
    """A run's ``job_end`` event in words: ``failed, exit 1: <reason>``."""
    code = job_end.get("exit_code")
    reason = f": {job_end['reason']}" if job_end.get("reason") else ""
    return f"{'done' if code == 0 else 'failed'}, exit {code}{reason}"


def job_state(snapshot: Mapping[str, Any] | None) -> str:
    job = snapshot.get("job") if snapshot else None
    return str(job.get("state", "unknown")) if isinstance(job, dict) else "unknown"


def _job_id(snapshot: Mapping[str, Any] | None) -> str:
    job = snapshot.get("job") if snapshot else None
    return str(job.get("id", "?")) if isinstance(job, dict) else "?"
