"""One typed error hierarchy for unicron.

Every error a user can meet is a ``UnicronError`` with an ``exit_code``; the CLI prints
``str(err)`` as one line and exits with that code. Internal failures that are *values*
(a worker's exit, a dropped message) are not exceptions: see ``unicron.detect`` and
``unicron.proto``.
"""

from __future__ import annotations


class UnicronError(Exception):
    """Base of every error unicron reports to a user."""

    exit_code: int = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(UnicronError):
    """A bad flag, a contradictory combination, or a missing required value."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file or environment variable that cannot be used."""


class InputError(UsageError):
    """A bad input file (e.g. ``unicron plan --input``); the message names the field."""


class ProtocolError(UnicronError):
    """A message on the mesh that is malformed, unsigned, stale or replayed."""

    exit_code = 3


class RendezvousError(UnicronError):
    """Nodes did not gather in time, or a node was refused by the job."""

    exit_code = 4


class EndpointUnreachableError(UnicronError):
    """A coordinator endpoint did not answer (e.g. ``unicron status --endpoint``)."""

    exit_code = 5


class ResourceError(UnicronError):
    """This node lacks what the job needs of it (open files): nothing was started."""


class WorkerFailedError(UnicronError):
    """Workers failed and unicron gave up; the message leads with the root cause. ``exit_code``:
    the job's, where another process decided it (an agent exits with its coordinator's code)."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class FatalUserError(WorkerFailedError):
    """A failure restarting cannot fix (ImportError, SyntaxError, bad arguments)."""


class CrashLoopError(WorkerFailedError):
    """Restarts make no progress: the job is stopped instead of looping forever."""


class RestartBudgetExceeded(WorkerFailedError):
    """The job-wide ``--max-restarts`` budget is spent."""


class Interrupted(UnicronError):
    """The launcher was stopped by SIGINT/SIGTERM; workers were stopped and reaped."""

    def __init__(self, signum: int, *, workers: bool = True) -> None:
        import signal

        name = signal.Signals(signum).name
        # before any worker started (a Ctrl-C at rendezvous): nothing was stopped (27B F11)
        super().__init__(f"interrupted by {name}; all workers stopped" if workers else f"interrupted by {name}")
        self.signum = signum
        self.exit_code = 128 + signum
