"""The ``unicron`` console script's entry point.

It imports the CLI while SIGINT and SIGTERM are only noted: the imports take most of a second
(typer, rich, networkx), and a Ctrl-C in that window used to end in a traceback, or in exit 130
with no line at all (a KeyboardInterrupt raised inside an import can be swallowed by CPython's
import machinery, or escape before any handler). A signal noted there ends the launcher with the
one line every other interruption gets, and 128 + its number.
"""

from __future__ import annotations

import signal
import sys
from typing import Any


def entrypoint() -> None:
    received: list[int] = []

    def note(signum: int, _frame: Any) -> None:
        received.append(signum)

    # A signal ignored when we started stays ignored (a background job's SIGINT: shells start
    # them so, and a Ctrl-C at the terminal is not for them).
    watched = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, note) for sig in watched}
    try:
        from unicron.cli import main
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        sys.stderr.write(f"unicron: error: interrupted by {signal.Signals(received[0]).name}\n")
        sys.stderr.flush()
        sys.exit(128 + received[0])
    sys.exit(main())
