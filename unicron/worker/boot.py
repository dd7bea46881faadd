"""Worker entry point: ``python -u -m unicron.worker.boot [--module] SCRIPT ARGS...``.

Installs the worker hooks (see ``unicron.worker.hooks``), then runs the script exactly as
``python -u SCRIPT ARGS`` (or ``python -u -m MODULE ARGS``) would: ``__name__ == "__main__"``,
``sys.argv == [SCRIPT, *ARGS]``, ``sys.path[0]`` the script's directory (the working directory
for ``--module``), classes defined in the script picklable, multiprocessing ``spawn`` working.

Exit status is the script's: its ``SystemExit`` code, or 1 for an uncaught exception, whose
traceback is printed as Python prints it (for ``--module``, without the two runpy frames
``python -m`` shows). Before
the process dies the exception is sent to the agent (``exc``) and, when
``TORCHELASTIC_ERROR_FILE`` is set and ``@record`` did not write it, written there in the
format of torch.distributed.elastic's ``@record``.

``main(argv)`` is also the entry for an interpreter that was started earlier (with torch
already imported) and is told to become a worker: set ``os.environ`` first, then call it.
"""

from __future__ import annotations

# First: the working directory off sys.path before anything else is imported (nocwd).
from unicron.worker import nocwd  # noqa: F401, I001

# isort: split
import atexit
import builtins
import importlib.machinery
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
import types
import zipfile
from dataclasses import dataclass
from types import TracebackType

from unicron.errors import UnicronError, UsageError
from unicron.worker import env, hooks, lateenv

USAGE = "usage: python -m unicron.worker.boot [--module] SCRIPT [ARGS...]"


@dataclass(frozen=True)
class Target:
    script: str  # a path, or a module name when module is True
    args: list[str]
    module: bool = False


def parse_argv(argv: list[str]) -> Target:
    """``[--module|-m] SCRIPT ARGS...`` -> Target (raises UsageError)."""
    if argv and argv[0] in ("--module", "-m"):
        if len(argv) < 2:
            raise UsageError(f"--module needs a module name; {USAGE}")
        return Target(argv[1], list(argv[2:]), module=True)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv or (argv[0].startswith("-") and argv[0] != "-"):
        raise UsageError(f"no script given; {USAGE}")
    return Target(argv[0], list(argv[1:]))


# What python's own __main__ holds that a fresh module does not: an empty __annotations__ up to
# 3.13 (from 3.14 annotations are lazy, and a preset dict would hide a script's own).
_MAIN_EXTRAS: dict[str, object] = {"__annotations__": {}} if sys.version_info < (3, 14) else {}


def run_target(target: Target) -> None:
    """Run the script or module as ``__main__`` with python's argv and path conventions."""
    sys.argv = [target.script, *target.args]
    # python -P (PYTHONSAFEPATH): nothing was put before the PYTHONPATH entries for this module
    # to take over, and nothing is for the script either.
    safe = bool(getattr(sys.flags, "safe_path", False))
    if target.module:
        # python -m: argv[0] is "-m" while the package imports, the module's file once it runs
        # (run_module's alter_sys sets that).
        sys.argv[0] = "-m"
        if not safe:
            sys.path.insert(0, os.getcwd())  # as python -m does (``nocwd`` took it off for the imports)
        runpy.run_module(target.script, run_name="__main__", alter_sys=True, init_globals=dict(_MAIN_EXTRAS))
    elif os.path.isfile(target.script) and not zipfile.is_zipfile(target.script):
        if not safe:
            sys.path.insert(0, os.path.dirname(os.path.realpath(target.script)))
        run_file_as_main(target.script)
    else:
        run_dir_as_main(target.script)


def run_file_as_main(script: str) -> None:
    """What ``python SCRIPT`` does: compile with the absolute path, exec as ``__main__``.

    The module stays ``sys.modules["__main__"]`` afterwards, as under python, so atexit
    handlers and pickling that refer to ``__main__`` keep working.
    """
    path = os.path.abspath(script)
    with io.open_code(path) as fh:
        source = fh.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __file__=path,
        __cached__=None,
        __package__=None,
        __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __builtins__=builtins,
        **_MAIN_EXTRAS,
    )
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


def run_dir_as_main(script: str) -> None:
    """What ``python DIR`` (or ``python APP.zip``) does: DIR first on ``sys.path``, its
    ``__main__`` module run as ``__main__`` (argv[0] stays as given)."""
    path = os.path.abspath(script)
    sys.path.insert(0, path)  # python -P too runs DIR's __main__ from DIR
    spec = importlib.machinery.PathFinder.find_spec("__main__", [path])
    code = spec.loader.get_code("__main__") if spec is not None and spec.loader is not None else None  # type: ignore[attr-defined]
    if spec is None or code is None:
        raise SystemExit(f"{sys.executable}: can't find '__main__' module in {script!r}")
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __file__=spec.origin,
        __cached__=spec.cached,
        __package__="",
        __spec__=spec,
        __loader__=spec.loader,
        __builtins__=builtins,
        **_MAIN_EXTRAS,
    )
    sys.modules["__main__"] = main_module
    exec(code, main_module.__dict__)


_OWN_FRAMES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__ or ""), "<frozen runpy>"}


def _is_own_frame(filename: str) -> bool:
    return filename in _OWN_FRAMES or os.path.abspath(filename) in _OWN_FRAMES


def script_traceback(tb: TracebackType | None) -> TracebackType | None:
    """Drop the leading frames of this module and runpy: what ``python SCRIPT`` would show."""
    while tb is not None and _is_own_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return tb


def error_file_record(exc: BaseException, tb_text: str, now: float) -> dict[str, object]:
    """What torch.distributed.elastic's ``@record`` writes for an exception."""
    return {
        "message": {
            "message": f"{type(exc).__name__}: {hooks.exception_message(exc)}",
            "extraInfo": {"py_callstack": tb_text, "timestamp": str(int(now))},
        }
    }


def write_error_file(exc: BaseException, tb_text: str, started_at: float) -> None:
    path = env.path_or_none(env.ERROR_FILE)
    if path is None:
        return
    try:
        if os.path.exists(path) and os.path.getmtime(path) >= started_at - 1.0:
            return  # written during this run, by @record: it knows best
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(error_file_record(exc, tb_text, time.time()), fh)
    except (OSError, ValueError, TypeError) as err:  # never instead of the exception it records
        try:
            print(f"unicron: could not write error file {path}: {err}", file=sys.stderr)
        except (OSError, ValueError):
            pass  # stderr is a file in the same full log directory


def _die_of_sigint() -> None:
    """Exit as python does after an uncaught KeyboardInterrupt: killed by SIGINT."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    hooks._real_os_exit(130)  # not reached unless SIGINT is blocked: exit as a shell reports it


def _is_clean_exit(code: object) -> bool:
    return code is None or code == 0


def die_with_agent(agent_pid: str | None = None) -> None:
    """Ask the kernel to SIGKILL this process if its agent (its parent) dies, even by SIGKILL,
    so a lost agent never leaves workers or its zygote behind. Linux only; else a no-op."""
    agent = os.environ.get("UNICRON_AGENT_PID", "") if agent_pid is None else agent_pid
    if not agent.isdigit() or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(agent):  # the agent died before the request took effect
        hooks._real_os_exit(137)


def main(argv: list[str] | None = None) -> int:
    started_at = time.time()
    die_with_agent()
    try:
        target = parse_argv(sys.argv[1:] if argv is None else argv)
        if not target.module and not os.path.exists(target.script):
            try:
                where = repr(os.path.abspath(target.script))
            except OSError:  # the working directory itself is gone (a redeploy, a cleaned scratch dir)
                where = f"{target.script!r} (the working directory {os.environ.get('PWD', '')!r} no longer exists)"
            raise UsageError(f"can't open file {where}: no such file")
        hooks.install()
        if "torch" in sys.modules:  # a warm fork: torch read its import-time variables already
            lateenv.watch_first_torch_import(os.environ)
    except UnicronError as err:
        print(f"unicron worker: {err}", file=sys.stderr)
        return err.exit_code
    try:
        hooks.fire_start_faults()
        run_target(target)
    except SystemExit as exit_:
        if _is_clean_exit(exit_.code):
            hooks.finished_cleanly()
        else:
            hooks.exiting(exit_.code)
        raise
    except BaseException as exc:
        # python prints value.__traceback__, not the tb argument: strip it on the exception
        tb = script_traceback(exc.__traceback__)
        exc.__traceback__ = tb
        tb_text = "".join(traceback.format_exception(type(exc), exc, tb))
        # The error file first: once the agent hears of the exception the job may stop at once,
        # and the launcher's own error file is copied from this one (unicron.agent.errorfile).
        write_error_file(exc, tb_text, started_at)
        first = hooks.traceback_first()
        if not first:
            hooks.report_exception(type(exc), exc, tb)
        try:
            sys.excepthook(type(exc), exc, tb)  # ours reports once, whichever comes first
        except (OSError, ValueError):
            pass  # stderr cannot be written (a full disk): the agent has the report
        finally:
            if first:
                hooks.report_exception(type(exc), exc, tb)
        if isinstance(exc, KeyboardInterrupt):
            _die_of_sigint()
        return 1
    hooks.finished_cleanly()
    return 0


if __name__ == "__main__":
    sys.exit(main())
