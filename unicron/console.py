"""The ``unicron`` console script's entry point.

It imports the CLI while SIGINT and SIGTERM are only noted: the imports take most of a second
(typer, rich, networkx), and a Ctrl-C in that window used to end in a traceback, or in exit 130
with no line at all (a KeyboardInterrupt raised inside an import can be swallowed by CPython's
import machinery, or escape before any handler). A signal noted there ends the launcher with the
one line every other interruption gets, and 128 + its number.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


def reopen_closed_stdio() -> None:
    """Put /dev/null where a standard descriptor is closed (`2>&-`, some daemonizers and cron
    wrappers): the launcher's own lines, the zygote (which duplicates fds 1 and 2) and the
    workers (which would inherit whatever the launcher opened next as their fd 0, 1 or 2) then
    see a stream, as torchrun's workers do."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, mode)  # the lowest free descriptor: ``fd`` itself, closed ones below it first
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        os.set_inheritable(fd, True)
        setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115 - the process's own stream


def entrypoint() -> None:
    reopen_closed_stdio()
    received: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)

    # Taken even when inherited ignored (a shell starts its background jobs with SIGINT so): the
    # launcher handles SIGINT once it runs, as torchrun's agent does, so a ``kill -INT`` in these
    # first moments of imports must not be dropped while the same signal later stops the job (31B F1).
    previous = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        from unicron.cli import main
    finally:
        for sig, handler in previous.items():
            if sig == signal.SIGINT and handler is signal.SIG_IGN:  # as Python sets it up where not ignored
                handler = signal.default_int_handler
            signal.signal(sig, handler)
    if received:
        sys.stderr.write(f"unicron: error: interrupted by {signal.Signals(received[0]).name}\n")
        sys.stderr.flush()
        sys.exit(128 + received[0])
    sys.exit(main())
