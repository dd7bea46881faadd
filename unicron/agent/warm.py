"""Warm starts: a zygote with torch imported forks workers, so no worker pays for interpreter start and imports.

A cold worker pays interpreter start plus ``import torch`` (seconds) before the first line of
training code; after a restart every rank pays it again, all at once. ``WarmPool`` starts one
zygote (``unicron.worker.zygote``) when the agent starts, in its own session; it imports once,
says ready, and then sleeps in ``read`` (no CPU) until it is asked for a worker. ``take`` sends
a worker's command, environment and log files and gets back the pid of a fresh fork that the
kernel has re-parented to us (the agent is a child subreaper); it returns a ``WorkerProcess``
that behaves exactly like ``start_worker``'s. The first attempt waits for the zygote (the agent
defers it while the zygote imports, up to ``READY_WAIT_S``), so every attempt, the first one
included, starts warm and no interpreter imports torch while the job trains. ``take`` returns
None whenever a warm start cannot be exactly a cold one, and the caller starts the worker cold:

- the command is not ``[python, "-u", "-m", "unicron.worker.boot", ...]`` for the pool's python;
- the zygote is not ready (still importing, or dead);
- a variable read at import time differs between the zygote and the worker (see
  ``warmspec.import_env_mismatch``), the working directory is gone, or a log file cannot be created.

The zygote notices end of input on its pipe and exits, and dies with the agent (PDEATHSIG).
``close`` kills and reaps it; the workers it forked are the agent's children and live on. A
zygote that fails to import (exits before saying ready) disables the pool: workers then start
cold, and ``disabled`` says why. One that dies later is restarted by ``refill``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from unicron.agent.logs import RankLogs
from unicron.agent.procs import ERROR_FILE_ENV, WorkerProcess
from unicron.agent.settings import AgentSettings
from unicron.agent.signals import is_child_subreaper
from unicron.agent.tee import ConsoleTee
from unicron.agent.warmspec import (
    boot_argv,
    import_env_mismatch,
    shadowed_preloads,
    spec_line,
)
from unicron.coord.stores import StoreHostChannel
from unicron.launch.workerenv import default_omp_threads
from unicron.worker.env import AGENT_ADDR

ZYGOTE_MODULE = "unicron.worker.zygote"
SPEC_PIPE_BYTES = 1 << 20  # room for the largest environment, so writing a spec never blocks
REAP_TIMEOUT_S = 5.0
TITLE_ROOM = 4000  # bytes of argument area each forked worker can rewrite to show its own command line

READY_WAIT_S = 300.0  # an attempt waits this long for a zygote still importing, then starts cold
FORK_REPLY_S = 10.0  # a ready zygote answers a spec within milliseconds; silence means it is stuck


class AdoptedChild:
    """A worker the zygote forked and the kernel re-parented to us: ``Popen``'s ``pid``/``poll``/``wait``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours after all (the subreaper setting was lost)
                self.returncode = 255
                return self.returncode
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


class WarmPool:
    """A zygote for ``python``, started under ``os.environ`` + ``base_env``, that forks warm workers.

    ``size`` 0 turns warm starts off. Warm starts need this process to be a child subreaper
    (the agent is): without it ``disabled`` says so and every worker starts cold.
    """

    def __init__(self, size: int, *, python: str, base_env: Mapping[str, str], inherit_env: bool = True,
                 host_stores: bool = False) -> None:
        if size < 0:
            raise ValueError(f"warm pool size must be >= 0, got {size}")
        self.size = size
        self.python = python
        self.zygote_env = {**(os.environ if inherit_env else {}), **base_env}
        self.disabled: str | None = None  # why no zygote is started any more
        self.closed = False
        self.taken = 0
        self.misses: Counter[str] = Counter()  # why take() returned None, by reason
        self.last_miss: str | None = None
        self.threads: int | None = None  # the zygote's thread count when it said ready
        self.started_at: float | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._spec_fd = -1
        self._reply_fd = -1
        self._replies = b""
        self._ready = False
        # The first zygote forks a store host for this node's coordinator (``host_stores``):
        # the coordinator takes ``store_channel``; ``store_pid`` is ours to reap.
        self.host_stores = host_stores
        self.store_channel: StoreHostChannel | None = None
        self._store_host: AdoptedChild | None = None

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- upkeep ----------------------------------------------------------------------
    def refill(self) -> int:
        """Start the zygote unless it runs (or the pool is off); returns how many were started. Does not wait."""
        self._prune()
        if self.closed or self.disabled is not None or self.size == 0 or self._popen is not None:
            return 0
        if not is_child_subreaper():
            self.disabled = "this process is not a child subreaper: forked workers would not be its children"
            return 0
        return 1 if self._start() else 0

    def idle(self) -> int:
        """1 while a zygote lives (ready or importing), else 0."""
        self._prune()
        return int(self._popen is not None)

    def ready(self) -> int:
        self._prune()
        self._read_replies(0)
        return int(self._ready and self._popen is not None)

    def settled(self) -> bool:
        """Whether an attempt need not wait: the zygote is ready, or there will be none."""
        return bool(self.ready()) or self._popen is None

    @property
    def store_pid(self) -> int | None:
        """The store host's pid while it lives (reaped, and forgotten, once it exited)."""
        host = self._store_host
        if host is not None and host.poll() is not None:
            self._store_host = host = None
        return host.pid if host is not None else None

    def pids(self) -> list[int]:
        self._prune()
        return [pid for pid in (self._popen.pid if self._popen is not None else None, self.store_pid) if pid]

    def wait_ready(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> bool:
        """Wait until the zygote has finished importing; False if it died or the time ran out."""
        deadline = clock() + timeout_s
        while not self.ready():
            remaining = deadline - clock()
            if self._popen is None or remaining <= 0:
                return False
            self._read_replies(min(remaining, 0.1))
        return True

    def close(self) -> None:
        """Kill and reap the zygote (it holds no state worth a graceful exit); workers it forked live on."""
        self.closed = True
        self._kill_zygote()
        host, self._store_host = self._store_host, None
        if host is not None and host.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(host.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.wait(REAP_TIMEOUT_S)

    # ---- forking a worker ------------------------------------------------------------
    def take(
        self,
        cmd: Sequence[str],
        env: Mapping[str, str],
        logs: RankLogs,
        *,
        tee: ConsoleTee | None = None,
        cwd: str | None = None,
        inherit_env: bool = True,
    ) -> WorkerProcess | None:
        """Start this rank from the zygote, exactly as ``start_worker(cmd, env, logs, ...)`` would; None: start it cold."""
        full_env = {**(os.environ if inherit_env else {}), **env}
        full_env[ERROR_FILE_ENV] = logs.error_file or ""  # as start_worker
        argv = boot_argv(cmd, self.python)
        workdir = _workdir(cwd)
        reason = self._why_cold(argv, full_env, workdir, logs)
        if reason is None and not self.ready():
            reason = "zygote still importing" if self._popen is not None else "no live zygote"
        if reason is not None or argv is None or workdir is None:
            self._miss(reason or "no live zygote")
            return None
        pid = self._fork(spec_line(argv, full_env, workdir, logs))
        if pid is None:
            return None
        worker = WorkerProcess(AdoptedChild(pid), local_rank=logs.local_rank, rank=logs.rank, cmd=cmd, logs=logs)
        if tee is not None:
            worker.add_exit_callback(tee.follow_rank(logs))
        self.taken += 1
        return worker

    def _why_cold(self, argv: list[str] | None, full_env: Mapping[str, str], workdir: str | None,
                  logs: RankLogs) -> str | None:
        """Why this worker cannot start warm exactly as it would cold (None: it can)."""
        if self.closed or self.size == 0:
            return "pool closed" if self.closed else "pool empty"
        if self.disabled is not None:
            return "pool disabled"
        if argv is None:
            return "not a boot command of the pool's python"
        mismatch = import_env_mismatch(self.zygote_env, full_env)
        if mismatch:
            return f"import-time environment differs: {', '.join(mismatch)}"
        if workdir is None:
            return "working directory is gone"
        shadow = shadowed_preloads(argv, workdir)
        if shadow:
            return f"the script's directory shadows preloaded {', '.join(shadow)}"
        try:  # what the cold spawn does before it forks (and fails on)
            for path in (logs.stdout_path, logs.stderr_path):
                if path:
                    open(path, "wb").close()
        except OSError:
            return "log file cannot be created"
        return None

    # ---- internals -------------------------------------------------------------------
    def _start(self) -> bool:
        spec_r, spec_w = os.pipe()
        reply_r, reply_w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(spec_w, fcntl.F_SETPIPE_SZ, SPEC_PIPE_BYTES)
        zygote_fds = [reply_w, spec_r]
        store_args: list[str] = []
        if self.host_stores and self.store_channel is None:  # the first zygote only: the host outlives it
            requests_r, requests_w = os.pipe()
            replies_r, replies_w = os.pipe()
            self.store_channel = StoreHostChannel(requests_w, replies_r)
            zygote_fds += [requests_r, replies_w]
            store_args = ["--store-fds", f"{requests_r},{replies_w}"]
        try:
            # Its stdin is ours, which its workers inherit, as cold workers do (pdb, input()).
            self._popen = subprocess.Popen(
                [self.python, "-u", "-m", ZYGOTE_MODULE, "--reply-fd", str(reply_w), "--spec-fd", str(spec_r),
                 *store_args, " " * TITLE_ROOM],
                env=self.zygote_env, pass_fds=zygote_fds, start_new_session=True,
            )
        except OSError as err:
            os.close(spec_w)
            os.close(reply_r)
            self.disabled = f"cannot start {self.python}: {err.strerror}"
            return False
        finally:
            for fd in zygote_fds:  # the zygote's ends: with them closed here, its exit is the host's end of input
                os.close(fd)
        self._spec_fd, self._reply_fd = spec_w, reply_r
        os.set_blocking(reply_r, False)
        self._replies, self._ready, self.started_at = b"", False, time.monotonic()
        return True

    def _fork(self, line: bytes) -> int | None:
        """Send one spec and wait for the pid (milliseconds: the zygote is ready); None if it failed."""
        try:
            os.write(self._spec_fd, line)
        except OSError:  # BrokenPipeError: it died
            self._lost("zygote died")
            return None
        reply = self._next_reply(FORK_REPLY_S)
        if reply is None:
            self._lost("zygote did not answer")
            return None
        pid = reply.get("pid")
        if not isinstance(pid, int) or pid <= 0:
            self._miss(f"zygote: {reply.get('error', 'no pid')}")
            return None
        return pid

    def _next_reply(self, timeout_s: float) -> dict[str, Any] | None:
        """The next line the zygote wrote, reading at least once (so 0 polls); None if none came in time."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._replies:
            if not self._read_once(deadline - time.monotonic()):
                return None
            if b"\n" not in self._replies and time.monotonic() >= deadline:
                return None
        line, _, self._replies = self._replies.partition(b"\n")
        try:
            reply = json.loads(line)
        except ValueError:
            return {"error": "unreadable reply"}
        return reply if isinstance(reply, dict) else {"error": "unreadable reply"}

    def _read_once(self, timeout_s: float) -> bool:
        """Read what the zygote wrote, waiting up to ``timeout_s``; False at end of input."""
        if self._reply_fd < 0:
            return False
        if not select.select([self._reply_fd], [], [], max(timeout_s, 0.0))[0]:
            return True
        try:
            data = os.read(self._reply_fd, 1 << 16)
        except BlockingIOError:
            return True
        if not data:
            return False
        self._replies += data
        return True

    def _read_replies(self, timeout_s: float) -> None:
        """Take the ready line if it came."""
        if self._ready or self._popen is None:
            return
        reply = self._next_reply(timeout_s)
        if reply is not None and reply.get("ready") is True:
            self._ready = True
            threads = reply.get("threads")
            self.threads = threads if isinstance(threads, int) else None
            store_pid = reply.get("store_pid")
            if isinstance(store_pid, int) and store_pid > 0 and self._store_host is None:
                self._store_host = AdoptedChild(store_pid)  # forked like a worker: ours to reap

    def _prune(self) -> None:
        """Forget a zygote that died; one that died before it was ready disables the pool."""
        popen = self._popen
        if popen is None or popen.poll() is None:
            return
        self._read_replies(0)
        was_ready = self._ready
        self._popen = None
        self._close_fds()
        code = popen.returncode
        if not was_ready and code is not None and code > 0 and not self.closed:
            self.disabled = f"the zygote exited with code {code} while importing; workers start cold"

    def _lost(self, reason: str) -> None:
        """The zygote failed us while ready: kill it (a later ``refill`` starts another)."""
        self._kill_zygote()
        self._miss(reason)

    def _kill_zygote(self) -> None:
        """SIGKILL its group and reap it; the workers it forked lead sessions of their own and live on."""
        popen, self._popen = self._popen, None
        self._close_fds()
        if popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(REAP_TIMEOUT_S)

    def _close_fds(self) -> None:
        for fd in (self._spec_fd, self._reply_fd):
            if fd >= 0:
                os.close(fd)
        self._spec_fd = self._reply_fd = -1
        self._ready = False

    def _miss(self, reason: str) -> None:
        self.misses[reason.split(":")[0]] += 1
        self.last_miss = reason


def _workdir(cwd: str | None) -> str | None:
    """The absolute working directory a cold worker would get, or None when it does not exist."""
    try:
        path = os.path.abspath(cwd if cwd is not None else os.getcwd())
    except OSError:  # the agent's own directory was removed
        return None
    return path if os.path.isdir(path) else None


def warm_pool(s: AgentSettings, agent_addr: str, *, host_stores: bool = False) -> WarmPool | None:
    """The agent's pool, its zygote starting; None with ``--no-warm`` or a command that is not
    the boot command (workers then start cold). ``host_stores``: this agent embeds the
    coordinator, whose stores the zygote's store host serves."""
    if not s.warm or boot_argv(list(s.cmd), s.cmd[0]) is None:
        return None
    # The workers' OMP_NUM_THREADS (torchrun's rule): numpy's BLAS starts no threads in the
    # zygote before it forks. The janitor's marker in the zygote's own environment:
    # /proc/PID/environ of a fork is its zygote's, so what a warm worker forks without exec
    # carries it too, and a SIGKILLed agent's janitor finds those with the rest.
    omp = default_omp_threads(os.environ, s.nproc)
    pool = WarmPool(s.nproc, python=s.cmd[0], base_env={AGENT_ADDR: agent_addr, **({"OMP_NUM_THREADS": omp} if omp else {})},
                    host_stores=host_stores)
    pool.refill()
    return pool
