"""A warm interpreter waiting to become a worker: ``python -u -m unicron.worker.zygote --ready-fd N``.

The agent's ``WarmPool`` (``unicron.agent.warm``) starts zygotes ahead of time. A zygote imports
unicron's worker code, numpy, torch and torch.distributed (the seconds a cold worker spends
before its first line of training code), writes one byte to ``--ready-fd``, then blocks in
``read(0)`` (no CPU) for one JSON line::

    {"argv": [(--module) SCRIPT ARGS...], "env": {...}, "cwd": "...", "stdout": path|null, "stderr": path|null}

and turns into exactly what ``python -u -m unicron.worker.boot ARGV`` started with that
environment, directory and log files would be: same pid/session (the pool started it with
``start_new_session``), ``os.environ`` replaced wholesale, ``sys.argv``/``sys.orig_argv`` of the
cold command, stdin on /dev/null, fds 1/2 on the log files (or the console the agent had), and
``unicron.worker.boot.main`` run with the same exit codes, tracebacks, error file and hooks.
End of input before a spec (the pool closed, or the agent died) exits 0 quietly.

What a warm worker cannot redo, and how it is handled:

- Variables read while importing (PYTHON*, LD_*, MALLOC_*, TORCH_*, OMP_*/MKL_*, locale, HOME,
  TMPDIR...): the pool refuses a worker whose values differ from the zygote's (cold start
  instead), see ``unicron.agent.warm.import_env_mismatch``. ``OMP_NUM_THREADS`` is the one that
  always differs (torchrun sets it per job): torch reads it at import, so it is applied with
  ``torch.set_num_threads``.
- CUDA: torch initialises it lazily; a zygote never touches a GPU, so CUDA_VISIBLE_DEVICES and
  friends set later take effect. A zygote whose imports did initialise CUDA exits before it
  says ready (the pool then starts workers cold).
- Output printed while importing (e.g. a numpy/torch warning) is captured and written first into
  the worker's stdout/stderr, where a cold worker would have printed it.
- ``tempfile.tempdir`` is reset (it caches TMPDIR). Signal handlers and faulthandler are left
  at python's defaults until ``hooks.install`` (as in a cold worker). ``random``, numpy and
  torch draw their default seeds per process when imported: every zygote is a fresh
  interpreter (never a fork), so no two workers share a seed, as with cold starts.
- Differences that remain: ``/proc/PID/cmdline`` shows the zygote command (``ps`` and tools
  that match processes by command line do not see the script), stdin is /dev/null rather than
  the agent's stdin, and ``sys.modules`` already holds torch/numpy before the script runs
  (a script that sets warning filters *before* ``import torch`` still sees torch's
  import-time warnings, replayed from the capture).
"""

from __future__ import annotations

import json
import os
import select
import sys
import tempfile
import threading
from typing import IO, Any

# Imported before torch, as in a cold worker: hooks remember the default excepthooks.
from unicron.worker import boot

# torch._dynamo is what the first optimizer construction imports (about 1.5 s): preloading it
# makes a warm worker's first step as fast as its later ones.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel", "zmq")
EXIT_PRELOAD_FAILED = 3  # before ready: the pool stops using zygotes
BOOT_MODULE = "unicron.worker.boot"


class SpecError(ValueError):
    """The pool sent something that is not a spec."""


def parse_spec(line: bytes) -> dict[str, Any]:
    """Decode and check one spec line (pure)."""
    try:
        spec = json.loads(line)
    except ValueError as err:
        raise SpecError(f"spec is not JSON: {err}") from None
    if not isinstance(spec, dict):
        raise SpecError("spec is not an object")
    argv, env, cwd = spec.get("argv"), spec.get("env"), spec.get("cwd")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise SpecError("spec argv must be a list of strings")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SpecError("spec env must map strings to strings")
    if not isinstance(cwd, str):
        raise SpecError("spec cwd must be a string")
    for stream in ("stdout", "stderr"):
        if spec.get(stream) is not None and not isinstance(spec[stream], str):
            raise SpecError(f"spec {stream} must be a path or null")
    return spec


def read_spec_line(fd: int) -> bytes | None:
    """Everything up to the first newline on ``fd``; None at end of input before any byte."""
    chunks: list[bytes] = []
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        chunks.append(data)
        if b"\n" in data:
            break
    line = b"".join(chunks)
    return line.split(b"\n", 1)[0] if line else None


class _Background:
    """Import at SCHED_IDLE: a zygote fills the pool while the job trains, and must take only
    CPU time training leaves unused. Normal scheduling returns once the imports are done, or at
    once if the zygote is handed its job while still importing (a helper thread watches stdin).
    Best effort: where the policy cannot be changed, the zygote imports at normal priority."""

    def __init__(self) -> None:
        self.tid = threading.get_native_id()
        self.idle = False
        self._wake_r, self._wake_w = os.pipe()
        self._thread: threading.Thread | None = None
        try:
            os.sched_setscheduler(self.tid, os.SCHED_IDLE, os.sched_param(0))
            self.idle = True
        except (AttributeError, OSError):
            return
        self._thread = threading.Thread(target=self._watch, name="unicron-zygote-wake", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        select.select([0, self._wake_r], [], [])
        self._normal()

    def _normal(self) -> None:
        if self.idle:
            try:
                os.sched_setscheduler(self.tid, os.SCHED_OTHER, os.sched_param(0))
            except OSError:
                pass
            self.idle = False

    def end(self) -> None:
        """Back to normal scheduling; no thread or descriptor of ours is left for the worker."""
        self._normal()
        os.write(self._wake_w, b"x")  # let the watcher thread finish
        if self._thread is not None:
            self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            continue  # not installed: a cold worker would not have it either
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("importing torch initialised CUDA; a zygote must not hold a GPU context")


class _Capture:
    """Points fds 1 and 2 at anonymous files while importing, keeping the console aside."""

    def __init__(self) -> None:
        self.console = (os.dup(1), os.dup(2))
        self.files: tuple[IO[bytes], IO[bytes]] = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        for fd, capture in zip((1, 2), self.files, strict=True):
            os.dup2(capture.fileno(), fd)

    def release(self, stdout: str | None, stderr: str | None) -> None:
        """fds 1/2 onto the worker's log files (or the console), captured output copied first."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, path, console, capture in zip((1, 2), (stdout, stderr), self.console, self.files, strict=True):
            if path is None:
                os.dup2(console, fd)
            else:
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                os.dup2(target, fd)
                os.close(target)
            capture.seek(0)
            captured = capture.read()
            if captured:
                os.write(fd, captured)
            capture.close()
            os.close(console)

    def restore_console(self) -> None:
        self.release(None, None)


def _stdin_from_devnull() -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def _apply_thread_count(env: dict[str, str]) -> None:
    """torch read OMP_NUM_THREADS when the zygote imported it; the worker's value wins."""
    torch = sys.modules.get("torch")
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if torch is None or not raw:
        return
    try:
        threads = int(raw)
    except ValueError:
        return  # torch ignores a value it cannot parse, and so do we
    if threads > 0:
        torch.set_num_threads(threads)


def become_worker(spec: dict[str, Any], capture: _Capture) -> int:
    """Turn this interpreter into the worker ``spec`` describes and run it; returns boot's exit code."""
    capture.release(spec.get("stdout"), spec.get("stderr"))
    _stdin_from_devnull()
    os.environ.clear()  # wholesale: nothing of the zygote's environment may leak
    os.environ.update(spec["env"])
    tempfile.tempdir = None
    _apply_thread_count(spec["env"])
    try:
        os.chdir(spec["cwd"])
    except OSError as err:
        print(f"unicron worker: cannot change to {spec['cwd']}: {err.strerror}", file=sys.stderr)
        return 1
    argv = list(spec["argv"])
    # What a cold `python -u -m unicron.worker.boot ARGV` has; a tool that re-executes itself
    # from orig_argv must start a worker, not a zygote that waits for a spec.
    sys.argv = [boot.__file__, *argv]
    sys.orig_argv = [sys.executable, "-u", "-m", BOOT_MODULE, *argv]
    return boot.main(argv)


def main(argv: list[str]) -> int:
    boot.die_with_agent(str(os.getppid()))  # an idle zygote must not outlive its agent either
    ready_fd: int | None = None
    if len(argv) == 2 and argv[0] == "--ready-fd":
        ready_fd = int(argv[1])
    capture = _Capture()
    background = _Background()
    try:
        _preload()
    except BaseException as err:  # any import failure: this zygote must never become a worker
        capture.restore_console()
        print(f"unicron zygote: preloading failed: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_PRELOAD_FAILED
    background.end()
    if ready_fd is not None:
        try:
            os.write(ready_fd, b"r")
        except OSError:
            pass  # nobody listens: a spec was sent before we were ready (or the pool is gone: EOF below)
        os.close(ready_fd)
    line = read_spec_line(0)
    if line is None:
        return 0  # the pool is gone: nothing to become
    try:
        spec = parse_spec(line)
    except SpecError as err:
        capture.restore_console()
        print(f"unicron zygote: {err}", file=sys.stderr)
        return 2
    return become_worker(spec, capture)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
