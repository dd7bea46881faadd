"""Warm restarts: a pool of zygote interpreters, torch already imported, ready to become workers.

A cold worker pays interpreter start plus ``import torch`` (seconds) before the first line of
training code; after a restart every rank pays it again, all at once. ``WarmPool`` keeps
``size`` zygotes (``unicron.worker.zygote``) started ahead of time, each in its own session
and blocked reading one spec line from a pipe (idle zygotes use no CPU; each holds the memory
of an interpreter with torch imported, a few hundred MB). ``take`` hands a worker's command,
environment and log files to one of them and returns a ``WorkerProcess`` that behaves exactly
like ``start_worker``'s; it returns None whenever a warm start cannot be exactly a cold one,
and the caller then starts the worker cold:

- the command is not ``[python, "-u", "-m", "unicron.worker.boot", ...]`` for the pool's python;
- no live zygote is idle (one still importing torch is used: the spec waits in its pipe);
- a variable read at import time differs between the zygote and the worker (see
  ``import_env_mismatch``), the working directory is gone, or a log file cannot be created.

A zygote notices end of input on its pipe and exits, so zygotes do not outlive an agent that
was killed. ``close`` kills and reaps the idle ones. Zygotes that fail to import (exit before
saying ready) disable the pool: restarts are then cold, and ``disabled`` says why.
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
from dataclasses import dataclass

from unicron.agent.logs import ConsoleTee, RankLogs
from unicron.agent.procs import ERROR_FILE_ENV, WorkerProcess

BOOT_MODULE = "unicron.worker.boot"
ZYGOTE_MODULE = "unicron.worker.zygote"
SPEC_PIPE_BYTES = 1 << 20  # room for the largest environment, so writing a spec never blocks
REAP_TIMEOUT_S = 5.0

# Read while python starts or torch/numpy/OpenMP load: a zygote imported under its own values.
_IMPORT_TIME_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "TORCH", "PYTORCH_", "OMP_", "KMP_", "GOMP_",
                         "MKL_", "OPENBLAS_", "NUMPY_", "LC_")
_IMPORT_TIME_NAMES = frozenset({"LANG", "LANGUAGE", "HOME", "TMPDIR", "TEMP", "TMP"})
# Read later (process group init, elastic error handling) or re-applied by the zygote.
_RUNTIME_PREFIXES = ("TORCHELASTIC_", "TORCH_NCCL_", "PYTHON_EXEC")
_REAPPLIED = frozenset({"OMP_NUM_THREADS"})  # torch.set_num_threads in the zygote


def is_import_time(name: str) -> bool:
    """Whether a variable may already have been read when a zygote finished importing."""
    if name in _REAPPLIED or name.startswith(_RUNTIME_PREFIXES):
        return False
    return name in _IMPORT_TIME_NAMES or name.startswith(_IMPORT_TIME_PREFIXES)


def import_env_mismatch(zygote_env: Mapping[str, str], worker_env: Mapping[str, str]) -> list[str]:
    """Import-time variables whose value (or presence) differs: a warm start would not be cold's."""
    names = {n for n in (*zygote_env, *worker_env) if is_import_time(n)}
    return sorted(n for n in names if zygote_env.get(n) != worker_env.get(n))


def boot_argv(cmd: Sequence[str], python: str) -> list[str] | None:
    """``[(--module) SCRIPT ARGS]`` of a boot command run by ``python``, else None."""
    head = [python, "-u", "-m", BOOT_MODULE]
    if len(cmd) <= len(head) or list(cmd[: len(head)]) != head:
        return None
    return list(cmd[len(head):])


REFILL_DELAY_S = 30.0  # refill anyway this long after an attempt started, steps reported or not


def should_refill(now: float, attempt_started_at: float, steps_completed: int, *,
                  delay_s: float = REFILL_DELAY_S) -> bool:
    """When to start replacement zygotes: once the attempt completed a step, or ``delay_s`` after it began.

    Not at once: new zygotes importing torch would compete for CPU with the workers that are
    starting (a cold first attempt imports torch itself). Calling ``refill`` on a full pool is cheap.
    """
    return steps_completed > 0 or now - attempt_started_at >= delay_s


def spec_line(argv: Sequence[str], env: Mapping[str, str], cwd: str, logs: RankLogs) -> bytes:
    """The one line a zygote reads to become a worker."""
    spec = {"argv": list(argv), "env": dict(env), "cwd": cwd, "stdout": logs.stdout_path,
            "stderr": logs.stderr_path}
    return json.dumps(spec, separators=(",", ":")).encode() + b"\n"


@dataclass
class _Zygote:
    popen: subprocess.Popen[bytes]
    spec_fd: int  # write end of the zygote's stdin
    ready_fd: int  # read end of the pipe it writes one byte to once imports are done
    ready: bool = False

    def check_ready(self) -> bool:
        if not self.ready and self.ready_fd >= 0:
            try:
                self.ready = os.read(self.ready_fd, 1) == b"r"
            except BlockingIOError:
                pass
        return self.ready

    def close_fds(self) -> None:
        for fd in (self.spec_fd, self.ready_fd):
            if fd >= 0:
                os.close(fd)
        self.spec_fd = self.ready_fd = -1


class WarmPool:
    """``size`` zygotes for ``python``, started under ``os.environ`` + ``base_env``."""

    def __init__(self, size: int, *, python: str, base_env: Mapping[str, str], inherit_env: bool = True) -> None:
        if size < 0:
            raise ValueError(f"warm pool size must be >= 0, got {size}")
        self.size = size
        self.python = python
        self.zygote_env = {**(os.environ if inherit_env else {}), **base_env}
        self.disabled: str | None = None  # why zygotes are no longer started
        self.closed = False
        self.taken = 0
        self.misses: Counter[str] = Counter()  # why take() returned None, by reason
        self.last_miss: str | None = None
        self._idle: list[_Zygote] = []

    def __enter__(self) -> WarmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- pool upkeep -----------------------------------------------------------------
    def refill(self) -> int:
        """Start zygotes until ``size`` are idle; returns how many were started. Does not wait."""
        self._prune()
        started = 0
        while not self.closed and self.disabled is None and len(self._idle) < self.size:
            zygote = self._start_one()
            if zygote is None:
                break
            self._idle.append(zygote)
            started += 1
        return started

    def idle(self) -> int:
        self._prune()
        return len(self._idle)

    def ready(self) -> int:
        self._prune()
        return sum(z.check_ready() for z in self._idle)

    def pids(self) -> list[int]:
        return [z.popen.pid for z in self._idle]

    def wait_ready(self, timeout_s: float, *, clock: Callable[[], float] = time.monotonic) -> bool:
        """Wait until every idle zygote has finished importing (tests, benchmarks)."""
        deadline = clock() + timeout_s
        while True:
            self._prune()
            waiting = [z for z in self._idle if not z.check_ready()]
            if not waiting:
                return bool(self._idle) or self.size == 0
            remaining = deadline - clock()
            if remaining <= 0:
                return False
            poller = select.poll()
            for z in waiting:
                poller.register(z.ready_fd, select.POLLIN)
            poller.poll(max(1, int(remaining * 1000)))

    def close(self) -> None:
        """Kill and reap every idle zygote (they hold no state worth a graceful exit)."""
        self.closed = True
        zygotes, self._idle = self._idle, []
        for z in zygotes:
            self._kill(z)
        for z in zygotes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                z.popen.wait(REAP_TIMEOUT_S)

    # ---- becoming a worker -----------------------------------------------------------
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
        """Start this rank in a zygote, exactly as ``start_worker(cmd, env, logs, ...)`` would; None: start it cold."""
        full_env = {**(os.environ if inherit_env else {}), **env}
        full_env[ERROR_FILE_ENV] = logs.error_file or ""  # as start_worker
        argv = boot_argv(cmd, self.python)
        workdir = _workdir(cwd)
        reason = self._why_cold(argv, full_env, workdir, logs)
        zygote = self._pick() if reason is None else None
        if zygote is None or argv is None or workdir is None:
            self._miss(reason or "no live zygote")
            return None
        self._idle.remove(zygote)
        if not self._send(zygote, spec_line(argv, full_env, workdir, logs)):
            self._kill(zygote)
            zygote.popen.wait(REAP_TIMEOUT_S)
            self._miss("zygote died")
            return None
        zygote.close_fds()  # end of input after the spec: the zygote reads no further
        worker = WorkerProcess(zygote.popen, local_rank=logs.local_rank, rank=logs.rank, cmd=cmd, logs=logs)
        if tee is not None:
            worker.add_exit_callback(tee.follow_rank(logs))
        self.taken += 1
        return worker

    def _why_cold(self, argv: list[str] | None, full_env: Mapping[str, str], workdir: str | None,
                  logs: RankLogs) -> str | None:
        """Why this worker cannot start warm exactly as it would cold (None: it can)."""
        if self.closed or self.size == 0:
            return "pool closed" if self.closed else "pool empty"
        if argv is None:
            return "not a boot command of the pool's python"
        mismatch = import_env_mismatch(self.zygote_env, full_env)
        if mismatch:
            return f"import-time environment differs: {', '.join(mismatch)}"
        if workdir is None:
            return "working directory is gone"
        try:  # what the cold spawn does before it forks (and fails on)
            for path in (logs.stdout_path, logs.stderr_path):
                if path:
                    open(path, "wb").close()
        except OSError:
            return "log file cannot be created"
        return None

    # ---- internals -------------------------------------------------------------------
    def _start_one(self) -> _Zygote | None:
        spec_r, spec_w = os.pipe()
        ready_r, ready_w = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(spec_w, fcntl.F_SETPIPE_SZ, SPEC_PIPE_BYTES)
        try:
            popen = subprocess.Popen(
                [self.python, "-u", "-m", ZYGOTE_MODULE, "--ready-fd", str(ready_w)],
                stdin=spec_r, env=self.zygote_env, pass_fds=(ready_w,), start_new_session=True,
            )
        except OSError as err:
            os.close(spec_w)
            os.close(ready_r)
            self.disabled = f"cannot start {self.python}: {err.strerror}"
            return None
        finally:
            os.close(spec_r)
            os.close(ready_w)
        os.set_blocking(spec_w, False)
        os.set_blocking(ready_r, False)
        return _Zygote(popen, spec_w, ready_r)

    def _prune(self) -> None:
        """Forget zygotes that died while idle; one that died before it was ready disables the pool."""
        for z in list(self._idle):
            if z.popen.poll() is None:
                continue
            was_ready = z.check_ready()
            self._idle.remove(z)
            z.close_fds()
            code = z.popen.returncode
            if not was_ready and code is not None and code > 0 and not self.closed:
                self.disabled = f"a zygote exited with code {code} while importing; restarts are cold"

    def _pick(self) -> _Zygote | None:
        """The first ready zygote, else the oldest one still importing."""
        self._prune()
        ready = [z for z in self._idle if z.check_ready()]
        candidates = ready or self._idle
        return candidates[0] if candidates else None

    @staticmethod
    def _send(z: _Zygote, line: bytes) -> bool:
        try:
            return os.write(z.spec_fd, line) == len(line)
        except OSError:  # BrokenPipeError (it died) or BlockingIOError (pipe smaller than the spec)
            return False

    @staticmethod
    def _kill(z: _Zygote) -> None:
        z.close_fds()
        if z.popen.returncode is None:  # not reaped: the pid (= its group) is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(z.popen.pid, signal.SIGKILL)

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
