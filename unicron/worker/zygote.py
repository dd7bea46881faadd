"""A fork server for warm workers: ``python -u -m unicron.worker.zygote --reply-fd N --spec-fd M``.

The agent's ``WarmPool`` (``unicron.agent.warm``) starts one zygote when the agent starts. It
imports unicron's worker code, numpy, torch and torch.distributed once (the seconds every cold
worker spends before its first line of training code), writes ``{"ready": true}`` on
``--reply-fd``, then blocks reading ``--spec-fd`` (no CPU) for JSON lines, one per worker::

    {"argv": [(--module) SCRIPT ARGS...], "env": {...}, "cwd": "...", "stdout": path|null, "stderr": path|null}

For each it forks twice (``fork_worker``): the worker is re-parented to the agent, which is a
child subreaper, and it answers ``{"pid": N}``. The worker is then what ``python -u -m
unicron.worker.boot ARGV`` spawned by the agent with that environment, directory and log files
would be: the agent's child (``waitpid``, PDEATHSIG and ``getppid`` behave as for a cold
worker), the leader of its own session, ``os.environ`` replaced wholesale, ``sys.argv`` /
``sys.orig_argv`` of the cold command, stdin the agent's (the zygote's own, which it never
reads), fds 1/2 on the log files (or the console the agent had), and
``unicron.worker.boot.main`` run with the same exit codes, tracebacks, error file and hooks.
The zygote itself never runs training code, so it forks from the same clean state every time:
a restart costs a fork, not an interpreter and its imports.
End of input (the pool closed, or the agent died) makes it exit 0 quietly.

Why forking a process with torch imported is safe here: torch initialises CUDA lazily and the
zygote never touches a GPU (one whose imports initialised CUDA, or the CUDA driver, exits
before it says ready, and the agent then starts workers cold; a driver merely mapped, as CUDA 13
builds of torch do on import, is no reason: see ``cudadriver``);
the zygote is started with the workers' OMP_NUM_THREADS, so numpy's BLAS starts no thread
pool and the zygote forks with one thread (it reports its thread count when ready); torch
creates its CPU thread pools on first use, in the worker.

What a warm worker cannot redo, and how it is handled:

- Variables read while importing (PYTHON*, LD_*, MALLOC_*, TORCH_*, OMP_*/MKL_*, locale, HOME,
  TMPDIR...): the pool refuses a worker whose values differ from the zygote's (cold start
  instead), see ``unicron.agent.warmspec.import_env_mismatch``. ``OMP_NUM_THREADS`` is applied
  with ``torch.set_num_threads``.
- A ``numpy.py``, ``torch/`` or ``zmq`` in the script's directory (``-m``: the working
  directory) would shadow the installed package in a cold worker, which puts that directory
  first on ``sys.path``: such a worker starts cold (``unicron.agent.warmspec.shadowed_preloads``).
- Output printed while importing (e.g. a numpy/torch warning) is captured and written first into
  each worker's stdout/stderr, where a cold worker would have printed it.
- Default seeds: ``random`` reseeds itself after a fork; numpy's and torch's global generators
  are reseeded from the OS (``_reseed``), so no two workers share a seed, as with cold starts.
  ``tempfile.tempdir`` is reset (it caches TMPDIR). Signal handlers and faulthandler are at
  python's defaults until ``hooks.install`` (as in a cold worker).
- The command line: a worker rewrites its argument area to show the cold command
  (``show_command``), so ``ps``, ``pgrep -f``/``pkill -f`` and psutil find the script; only
  ``/proc/PID/environ`` still shows the zygote's starting environment (``os.environ`` is right).
- Variables the script itself sets above its ``import torch``: applied at that import where
  torch can take them again, named where it cannot (``unicron.worker.lateenv``).
- Differences that remain: all workers share the zygote's string-hash seed (PYTHONHASHSEED), and
  ``sys.modules`` already holds torch/numpy before the script runs (a script that sets warning
  filters *before* ``import torch`` still sees torch's import-time warnings, replayed).
"""

from __future__ import annotations

# First: the working directory off sys.path before anything else is imported (nocwd).
from unicron.worker import nocwd  # noqa: F401, I001

# isort: split
import ctypes
import os
import signal
import sys
import tempfile
import time
from typing import IO, Any

# Imported before torch, as in a cold worker: hooks remember the default excepthooks.
from unicron.worker import boot, cudadriver
from unicron.worker.jsonlines import LineReader, read_object, write_object

# torch._dynamo is what the first optimizer construction imports (about 1.5 s): preloading it
# makes a warm worker's first step as fast as its later ones. unicron's worker API last: a
# worker forked after unicron was upgraded under a running job uses the zygote's version of
# all of it, never its old snapshot code beside a new ``unicron.State`` read from disk.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.optim", "torch._dynamo", "torch.nn.parallel", "zmq",
           "unicron.worker.state")
EXIT_PRELOAD_FAILED = 3  # before ready: the pool stops using zygotes
REPARENT_NAP_S = 0.0005
REPARENT_TIMEOUT_S = 5.0
BOOT_MODULE = "unicron.worker.boot"


class SpecError(ValueError):
    """The pool sent something that is not a spec."""


def parse_spec(line: bytes) -> dict[str, Any]:
    """Decode and check one spec line (pure)."""
    spec = read_object(line, "spec", SpecError)
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


def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            continue  # not installed: a cold worker would not have it either
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("importing torch initialised CUDA; a zygote must not hold a GPU context")
    if cudadriver.driver_state() == cudadriver.INITIALIZED:
        # An initialised CUDA driver does not survive fork (even without a context): forks of
        # this process would fail on their first CUDA call. A driver merely mapped (torch's
        # CUDA 13 builds map it on import) is fine.
        raise RuntimeError("importing initialised the CUDA driver (cuInit); workers cannot be forked from it")


class _Capture:
    """Points fds 1 and 2 at anonymous files while importing; ``end`` puts the console back and
    keeps what was printed, which every worker then writes first into its own stdout/stderr."""

    def __init__(self) -> None:
        self.console = (os.dup(1), os.dup(2))
        self.files: tuple[IO[bytes], IO[bytes]] = (tempfile.TemporaryFile(), tempfile.TemporaryFile())
        for fd, capture in zip((1, 2), self.files, strict=True):
            os.dup2(capture.fileno(), fd)
        self.captured: tuple[bytes, bytes] = (b"", b"")

    def end(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        captured = []
        for fd, console, capture in zip((1, 2), self.console, self.files, strict=True):
            os.dup2(console, fd)
            os.close(console)
            capture.seek(0)
            captured.append(capture.read())
            capture.close()
        self.captured = (captured[0], captured[1])

    def replay(self, stdout: str | None, stderr: str | None) -> None:
        """In a worker: fds 1/2 onto its log files (or left on the console), captured output first."""
        for fd, path, captured in zip((1, 2), (stdout, stderr), self.captured, strict=True):
            if path is not None:
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                os.dup2(target, fd)
                os.close(target)
            if captured:
                os.write(fd, captured)


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
    """Turn this (forked) interpreter into the worker ``spec`` describes and run it; returns boot's exit code."""
    for sig in SCRIPT_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    _reseed()
    capture.replay(spec.get("stdout"), spec.get("stderr"))
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
    show_command(sys.orig_argv)
    return boot.main(argv)


def show_command(args: list[str]) -> bool:
    """Make ``ps``, ``pgrep -f`` and psutil show the cold command line instead of the zygote's.

    Rewrites this process's argument area in place (as setproctitle(3) does): the arguments
    joined by spaces, a NUL, and a non-NUL last byte, which tells the kernel the area holds one
    title. The pool gives the zygote an argument of ``TITLE_ROOM`` spaces so there is room;
    a longer command is cut. Linux only; False where it could not be done.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2:].split()  # fields[0] is field 3 of proc(5)
        arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49
    except (OSError, ValueError, IndexError):
        return False
    room = arg_end - arg_start
    if room < 2:
        return False
    title = " ".join(args).encode(errors="replace")[: room - 2]
    area = title + b"\0" * (room - len(title) - 1) + b" "
    ctypes.memmove(arg_start, area, room)
    return True


def _reseed() -> None:
    """Fresh default seeds, as a new interpreter draws them (``random`` reseeds itself after a fork)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()


def fork_worker(reply_fd: int, spec_fd: int) -> int | None:
    """Fork twice so the worker is re-parented to the agent (a child subreaper) as if spawned by it.

    Returns the worker's pid in the zygote and None in the worker, which by then leads its own
    session and is the agent's child (so PDEATHSIG, ``getppid`` and ``waitpid`` are a cold worker's).
    """
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the worker and vanish without cleanup
        middle_pid = os.getpid()  # known before the fork: the worker may start after we are gone
        try:
            os.close(r)
            pid = os.fork()
        except BaseException:
            os._exit(1)
        if pid == 0:
            for fd in (reply_fd, spec_fd):
                os.close(fd)
            os.setsid()  # before the agent learns our pid, so killpg(pid) reaches us from the start
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            # Counted in naps, not by the clock: a node stopped whole (SIGSTOP, a VM pause) right
            # here must not make the worker give up on waking, as a deadline would.
            naps = int(REPARENT_TIMEOUT_S / REPARENT_NAP_S)
            while os.getppid() == middle_pid:
                naps -= 1
                if naps < 0:  # boot's PDEATHSIG check then ends this worker
                    print(f"unicron worker: not re-parented within {REPARENT_TIMEOUT_S:g} s", file=sys.stderr)
                    break
                time.sleep(REPARENT_NAP_S)  # the intermediate exits right after the fork
            return None
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 64):  # end of input: the worker wrote its pid, the intermediate is gone
        data += chunk
    os.close(r)
    os.waitpid(middle, 0)  # reaped: the worker is re-parented by the time the agent hears its pid
    return int(data) if data.isdigit() else -1


def parse_args(argv: list[str]) -> tuple[int, int, tuple[int, int] | None] | None:
    """(reply fd, spec fd, store host's (requests, replies) fds or None); None if malformed (pure)."""
    if argv and not argv[-1].strip():
        argv = argv[:-1]  # the spaces are title room
    if len(argv) not in (4, 6) or argv[0] != "--reply-fd" or argv[2] != "--spec-fd":
        return None
    if not (argv[1] + argv[3]).isdigit():
        return None
    store_fds = None
    if len(argv) == 6:
        requests, _, replies = argv[5].partition(",")
        if argv[4] != "--store-fds" or not (requests.isdigit() and replies.isdigit()):
            return None
        store_fds = (int(requests), int(replies))
    return int(argv[1]), int(argv[3]), store_fds


def _fork_store_host(reply_fd: int, spec_fd: int, store_fds: tuple[int, int], agent_pid: str) -> int | None:
    """Fork the store host (``unicron.worker.storehost``) like a worker; its pid here (-1: the
    fork failed), and in the store host itself, never returns."""
    pid = fork_worker(reply_fd, spec_fd)
    if pid is None:
        boot.die_with_agent(agent_pid)  # re-parented by now: the agent is its parent
        null = os.open(os.devnull, os.O_RDWR)  # it reads and prints nothing; stderr stays for a crash
        for fd in (0, 1):
            os.dup2(null, fd)
        os.close(null)
        show_command([sys.executable, "-m", "unicron.worker.storehost", "(the rendezvous stores of this node's coordinator)"])
        from unicron.worker import storehost

        code = 0
        try:
            code = storehost.serve(*store_fds)
        finally:
            os._exit(code)  # nothing of the zygote's exit handlers
    for fd in store_fds:  # the host holds them now: its end of input is the coordinator's
        os.close(fd)
    return pid


# Slurm's ``--signal=USR1@90`` reaches every process of the step: the scripts' own signals, which
# killed the zygote and the store host it forks, and with it the workers' store (acceptance 25A
# F3). They ignore them; a worker gets the default action back (``become_worker``), as a cold one
# has it (``unicron.agent.signals.SCRIPT_SIGNALS``).
SCRIPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    agent_pid = str(os.getppid())
    boot.die_with_agent(agent_pid)  # the zygote must not outlive its agent
    for sig in SCRIPT_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    args = parse_args(argv)
    if args is None:
        print("usage: python -m unicron.worker.zygote --reply-fd N --spec-fd M [--store-fds R,W] [SPACES]",
              file=sys.stderr)
        return 2
    reply_fd, spec_fd, store_fds = args
    capture = _Capture()
    try:
        _preload()
    except BaseException as err:  # any import failure: this zygote must never fork a worker
        capture.end()
        print(f"unicron zygote: preloading failed: {type(err).__name__}: {err}", file=sys.stderr)
        return EXIT_PRELOAD_FAILED
    capture.end()
    ready: dict[str, Any] = {"ready": True, "threads": len(os.listdir("/proc/self/task"))}
    if store_fds is not None:  # forked while this process has one thread, before any worker
        ready["store_pid"] = _fork_store_host(reply_fd, spec_fd, store_fds, agent_pid)
    if not write_object(reply_fd, ready):
        return 0
    specs = LineReader(spec_fd)
    while (line := specs.next_line()) is not None:
        try:
            spec = parse_spec(line)
        except SpecError as err:
            if not write_object(reply_fd, {"error": str(err)}):
                return 0
            continue
        pid = fork_worker(reply_fd, spec_fd)
        if pid is None:
            return become_worker(spec, capture)
        if not write_object(reply_fd, {"pid": pid} if pid > 0 else {"error": "fork failed"}):
            return 0
    return 0  # end of input: the pool is closed, or the agent is gone


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
