"""Hooks installed in every worker: iteration boundaries, exceptions, stack dumps, faults.

- **Steps.** A global optimizer step post-hook counts completed steps, counting only the first
  optimizer that ever stepped (several optimizers stepping in one iteration count once). Scripts
  with custom loops call ``unicron.step()``; from the first explicit call on, optimizer steps are
  no longer counted, so nothing is counted twice (that first call takes over the boundary the
  optimizer just marked). ``unicron.step(n)`` sets the count exactly. Every boundary sends ``step{rank,step,ts}``
  and gives injected faults their chance to fire. The hook is registered when
  ``torch.optim.optimizer`` is first imported, so a worker that never imports torch never pays
  for it.
- **Exceptions.** ``sys.excepthook`` and ``threading.excepthook`` send ``exc{...}`` (once per
  exception) before chaining to the previous hook.
- **Stacks.** ``faulthandler`` dumps every thread's Python stack to
  ``$UNICRON_STACK_DIR/rank{RANK}.txt`` on ``env.STACK_SIGNAL`` (SIGRTMIN+4). It runs in the C signal handler, so it
  works while the main thread is blocked inside a C++ collective. The file is opened in append
  mode: a reader truncates it (never unlinks it) before signalling, or reads past the old size.
- **Past start-up.** Once ``torch.distributed`` is initialised (checked every
  ``READY_POLL_S`` by a thread that ends at the first step), ``ready`` tells the agent that this
  rank got past its start-up: a script that never reports steps (a loop without ``torch.optim``)
  is then not "before the first step" when it fails, but of unknown progress. ``exc`` and
  ``exiting`` (a non-zero ``SystemExit``, sent before the interpreter tears down, while peers
  may already see its sockets close) carry the same flag. ``optim`` says the rank built a
  ``torch.optim`` optimizer (``Optimizer.__init__`` is wrapped): it will report steps, so it
  stays "before the first step" until it does.
- **Past the collectives.** ``destroy_process_group()`` of the default group is wrapped to send
  ``closed`` as it is called (its peers' collectives fail on it before it returns): no
  collective of the job can join every rank again, so what the ranks do after it (a save, an
  upload, ``wandb.finish()``) is not a hang. A step reported after
  it, or ``init_process_group`` after it (``opened``: the script makes a new group), takes
  that back.
- **Hard exits.** ``os._exit`` (common after ``destroy_process_group``) skips atexit, so it is
  wrapped to finish pending snapshot writes, say ``bye`` on code 0 and flush the channel first.

The wrappers of torch's functions (``Optimizer.__init__``, ``destroy_process_group``,
``init_process_group``) are in ``unicron.worker.torchwraps``; this module installs them.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import IO, Any, NoReturn

from unicron.textclip import FAULT_FIELD_LIMITS, clip
from unicron.worker import channel, env, importwatch, torchwraps
from unicron.worker.inject import Fault, faults_at, fire, parse_inject_spec
from unicron.worker.liveness import FrameWatch, count_batches_of
from unicron.worker.steps import StepCounter

OPTIMIZER_MODULE = "torch.optim.optimizer"
READY_POLL_S = 0.2
DDP_MODULE = "torch.nn.parallel.distributed"
C10D_MODULE = "torch.distributed.distributed_c10d"


class _Runtime:
    def __init__(self) -> None:
        self.counter = StepCounter()
        self.faults: list[Fault] = []
        self.rank = 0
        self.installed = False
        self.stack_file: IO[str] | None = None
        self.optimizer_hook: Any = None  # torch RemovableHandle
        self.optimizer_built = False
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()  # every one built: State warns of one left out
        self.reported: set[int] = set()  # id()s of exceptions already sent
        self.hard_exit_callbacks: list[Callable[[int], object]] = []
        self.snapshot_step: int | None = None  # of unicron.State's newest complete snapshot
        self.pid = os.getpid()
        # Tells the agent while this worker's Python keeps moving between steps (evaluation,
        # compilation), so a long phase between steps is not taken for a hang.
        self.frames = FrameWatch(lambda: channel.get().emit("moved"), emit_data=lambda: channel.get().emit("data"),
                                 emit_alive=lambda: channel.get().emit("alive"))


_rt = _Runtime()
_real_os_exit = os._exit
_prev_excepthook = sys.excepthook
_prev_threading_excepthook = threading.excepthook


# -- steps ------------------------------------------------------------------------------------


def _boundary(completed: int, since: int | None = None) -> None:
    """Announce the steps after ``since`` (default: the one before) up to ``completed``."""
    counts = range(completed if since is None else since + 1, completed + 1)
    # The newest complete snapshot rides on the step message: a message of its own woke the
    # agent once more per step and rank, launcher CPU a snapshot-every-step job paid for.
    for n in counts:  # several at once where a replacing optimizer's earlier steps count too
        channel.get().emit("step", step=n, snap=_rt.snapshot_step)
    _rt.frames.boundary()
    if _rt.faults:  # after every announcement: one that raises leaves no step unannounced
        for n in counts:
            for fault in faults_at(_rt.faults, _rt.rank, n):
                if fault.kind != "slow" or n == completed:  # a straggler's delay once per boundary
                    fire(fault, _rt.rank, n)


def _on_optimizer_step(optimizer: object, args: Any, kwargs: Any) -> None:
    counts = _rt.counter.on_optimizer_step(optimizer)
    if counts:
        _boundary(counts[-1], counts[0] - 1)


def step(completed: int | None = None) -> int:
    """Mark an iteration boundary in a custom loop; returns the completed-step count.

    ``completed`` sets the count (e.g. after resuming); by default it is the previous count + 1.
    After the first call, optimizer steps are no longer counted.
    """
    n = _rt.counter.on_explicit_step(completed)
    if n is not None:
        _boundary(n)
    return _rt.counter.completed


def built_optimizers() -> list[Any]:
    """The optimizers this process built and still holds (with the hooks installed; else none)."""
    return list(_rt.optimizers)


def completed_steps() -> int:
    return _rt.counter.completed


def note_state() -> None:
    """A ``unicron.State`` was made: this rank restarts from its snapshots or from step 0, so
    the agent may compare its steps across attempts (a script's own resume it cannot see)."""
    channel.get().emit("state")


def note_snapshot(step: int) -> None:
    """``unicron.State`` completed a snapshot of ``step``: the next step message tells the agent."""
    _rt.snapshot_step = step


def set_completed_steps(completed: int) -> None:
    """Rebase the count, without a boundary (``State.restore`` after resuming at a step)."""
    _rt.counter.rebase(completed)


def _register_optimizer_hook(optimizer_module: ModuleType) -> None:
    if _rt.optimizer_hook is None:
        _rt.optimizer_hook = optimizer_module.register_optimizer_step_post_hook(_on_optimizer_step)
    torchwraps.announce_optimizers(optimizer_module, _optimizer_built)


def _optimizer_built(optimizer: Any) -> None:
    """Send ``optim`` when this rank builds its first optimizer: it will report steps, so until
    it does it is before its first step (start-up), however long that takes, and never a
    script of unknown progress."""
    _rt.optimizers.add(optimizer)
    if not _rt.optimizer_built:
        _rt.optimizer_built = True
        channel.get().emit("optim")


def _install_ddp_layouts(ddp_module: ModuleType) -> None:
    from unicron.worker import ddplayout

    ddplayout.install(ddp_module)


def _raised_as_group_destroyed(err: BaseException) -> None:
    """The default group is destroyed with ``err`` on its way out (``torchwraps``): reported
    now, as pending (it may yet be caught; the rank's exit decides)."""
    if isinstance(err, SystemExit):
        exiting(err.code, pending=True)
    else:
        report_exception(type(err), err, err.__traceback__, pending=True)


# Modules to hook right after they are executed, and how.
_AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {
    OPTIMIZER_MODULE: _register_optimizer_hook,
    DDP_MODULE: _install_ddp_layouts,
    C10D_MODULE: functools.partial(torchwraps.announce_destroy, past_end=lambda: _rt.frames.tail(),
                                   raised=_raised_as_group_destroyed),
    "torch.utils.data.dataloader": count_batches_of,
}


# -- exceptions -------------------------------------------------------------------------------


def exception_type_name(exc_type: type[BaseException]) -> str:
    """The type as Python's traceback prints it (``RuntimeError``, ``torch.distributed.X``)."""
    module = exc_type.__module__
    qualname = exc_type.__qualname__
    return qualname if module in ("builtins", "__main__") else f"{module}.{qualname}"


def exception_message(exc: BaseException) -> str:
    """``str(exc)``; for a broken ``__str__``, what Python's own traceback prints for it."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


def report_exception(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None, *, fatal: bool = True,
    pending: bool = False,
) -> None:
    """Send ``exc{rank,type,msg,tb,fatal,ts}`` for this exception, once. ``fatal`` is False for
    an exception that ended only a background thread: the agent records it but does not stop
    the job for it. ``pending``: it may yet be caught (see ``torchwraps.announce_destroy``); sent again
    unpending if it ends the script."""
    if id(exc) in _rt.reported:
        return
    if not pending:
        _rt.reported.add(id(exc))
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    message = exception_message(exc)
    # Bounded: the agent's channel drops a message over 1 MiB, and this one must arrive.
    channel.get().emit("exc", type=clip(exception_type_name(exc_type), FAULT_FIELD_LIMITS["error_type"]),
                       msg=clip(message, FAULT_FIELD_LIMITS["message"]),
                       tb=clip(text, FAULT_FIELD_LIMITS["traceback"]), fatal=fatal, ready=distributed_ready(),
                       **({"pending": True} if pending else {}))


def exiting(code: object, *, pending: bool = False) -> None:
    """Announce a non-zero ``SystemExit`` before the interpreter tears down: the exit code is
    the root cause, and peers may fail on this rank's closed sockets before the agent can reap it.
    ``pending``: it may yet be caught (see ``torchwraps.announce_destroy``): the script goes on for now."""
    if not pending:
        _rt.frames.stop()
    # The status the process will have: sys.exit(-1) is 255, sys.exit(256) is 0.
    status = (int(code) if isinstance(code, int) else 1) & 0xFF
    channel.get().emit("exiting", code=status, ready=distributed_ready(), **({"pending": True} if pending else {}))


# -- start-up ---------------------------------------------------------------------------------


def distributed_ready() -> bool:
    """``torch.distributed`` is initialised (never imports it)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and bool(dist.is_available() and dist.is_initialized())
    except Exception:  # a half-imported or unusual torch: no evidence
        return False


def _watch_ready() -> None:
    # Ends at the first step (steps are better evidence) or once ready is sent.
    while _rt.counter.completed == 0 and not _rt.counter.explicit:
        if distributed_ready():
            channel.get().emit("ready")
            return
        time.sleep(READY_POLL_S)


def traceback_first() -> bool:
    """Whether the hook in place is Python's own, which only writes the traceback (to the rank's
    log file: it never blocks): written before the agent hears of the exception, it is on the
    console before the agent's line about it (34A F5). A script's own hook (an error reporter
    that uploads) may wait: the agent hears first then."""
    hook = sys.excepthook
    return hook is sys.__excepthook__ or (hook is _excepthook and _prev_excepthook is sys.__excepthook__)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    _rt.frames.stop()  # the main thread is done: hold none of its frames through shutdown
    if traceback_first():
        try:
            _prev_excepthook(exc_type, exc, tb)
        finally:
            report_exception(exc_type, exc, tb)
        return
    try:
        report_exception(exc_type, exc, tb)
    finally:
        _prev_excepthook(exc_type, exc, tb)


def _threading_excepthook(args: Any) -> None:
    try:
        if args.exc_type is not SystemExit and args.exc_value is not None:
            report_exception(args.exc_type, args.exc_value, args.exc_traceback, fatal=False)
    finally:
        _prev_threading_excepthook(args)


# -- exits ------------------------------------------------------------------------------------


def add_hard_exit_callback(callback: Callable[[int], object]) -> None:
    """Run ``callback(code)`` before ``os._exit`` in this process (e.g. finish a snapshot)."""
    _rt.hard_exit_callbacks.append(callback)


def finished_cleanly() -> None:
    _rt.frames.stop()
    _rt.frames.tail()  # past its end: ``alive`` while the interpreter tears down (unicron.agent.frozen)
    channel.get().emit("bye")


def _os_exit(status: int) -> NoReturn:
    if os.getpid() == _rt.pid:  # forked children (dataloader workers) exit untouched
        try:
            for callback in list(_rt.hard_exit_callbacks):
                callback(status)
            if status == 0:
                finished_cleanly()
            else:  # the code is the root cause; peers may fail on the closed sockets first
                exiting(status)
            channel.get().close()
        except BaseException:  # an exit must happen whatever the cleanup does
            pass
    _real_os_exit(status)


def _before_exec(real: Callable[..., NoReturn]) -> Callable[..., NoReturn]:
    """``os.execv``/``os.execve`` (every ``os.exec*`` ends in one) that first tell the agent:
    the new image runs without these hooks, no stack-dump handler (the agent's signal for
    stacks would kill it) and no step reports, so its progress is unknown from then on."""

    def execute(*args: Any) -> NoReturn:
        if os.getpid() == _rt.pid:  # a forked child's exec is its own business
            try:
                channel.get().emit("exec")
                channel.get().close()  # flushed now: zmq's I/O thread dies with this image
            except BaseException:  # the exec must happen whatever the channel does
                pass
        real(*args)  # should it fail (no such file), the script goes on with no channel

    execute.__wrapped__ = real  # type: ignore[attr-defined]
    return execute


# -- install ----------------------------------------------------------------------------------


def _install_stack_dump(stack_dir: str, rank: int) -> None:
    os.makedirs(stack_dir, exist_ok=True)
    # Kept open for the life of the process: faulthandler writes to its fd from a signal handler.
    _rt.stack_file = open(os.path.join(stack_dir, f"rank{rank}.txt"), "a", encoding="utf-8")
    faulthandler.register(env.STACK_SIGNAL, file=_rt.stack_file, all_threads=True, chain=False)


def install() -> None:
    """Install every hook from the environment; idempotent. Raises UnicronError on bad env."""
    if _rt.installed:
        return
    _rt.pid = os.getpid()
    _rt.rank = env.rank()
    spec = env.path_or_none(env.INJECT)
    _rt.faults = parse_inject_spec(spec) if spec else []
    channel.get().emit("hello", local_rank=env.local_rank(), pid=os.getpid())
    idle = env.numbers_or_none(env.HANG_IDLE, 2)
    if idle is not None:
        _rt.frames.idle_threshold(*idle)
    watch_start = env.seconds_or_none(env.WATCH_START)
    if watch_start is not None:
        # The agent judges the start-up from then on: say from the start, not the first step,
        # when Python moves, batches come or the rank waits for data.
        _rt.frames.begin(watch_start)
    stack_dir = env.path_or_none(env.STACK_DIR)
    if stack_dir:
        _install_stack_dump(stack_dir, _rt.rank)
    sys.excepthook = _excepthook
    threading.excepthook = _threading_excepthook
    os._exit = _os_exit
    os.execv, os.execve = _before_exec(os.execv), _before_exec(os.execve)
    importwatch.after_import(_AFTER_IMPORT)
    try:
        threading.Thread(target=_watch_ready, name="unicron-ready", daemon=True).start()
    except RuntimeError:  # no thread to be had: the agent just knows less
        pass
    _rt.installed = True


def fire_start_faults() -> None:
    """Faults injected at STEP 0 fire here, before the script runs."""
    for fault in faults_at(_rt.faults, _rt.rank, 0):
        fire(fault, _rt.rank, 0)
