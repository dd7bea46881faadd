"""A watcher that removes the agent's directories when the agent dies without doing it.

The agent removes its shared-memory snapshot directory and its IPC directory on every path it
controls. A SIGKILL, the kernel's OOM killer or a signal it does not handle (SIGUSR1) gives it
no such path, and the snapshots (model and optimizer state, three steps of it per rank) would
hold that much RAM in ``/dev/shm`` until the next agent on the machine cleans up (``shm.py``).

So the agent starts this small process (``python -S``, a few standard modules: a few MB) with
the read end of a pipe. It waits for end of input, which comes when the agent closes the pipe
(it has removed the directories by then) or dies (the kernel closes it), and removes whatever
of the directories is still there. It runs in a session of its own, ignoring the terminal's
signals, so a Ctrl-C that also reaches the agent does not take it first.
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROGRAM = """
import os, shutil, signal, sys
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT):
    signal.signal(sig, signal.SIG_IGN)
fd = int(sys.argv[1])
try:
    while os.read(fd, 4096):
        pass
except OSError:
    pass
for path in sys.argv[2:]:
    shutil.rmtree(path, ignore_errors=True)
"""


class Janitor:
    def __init__(self, paths: list[str], python: str = sys.executable) -> None:
        read_fd, self._write_fd = os.pipe()
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [python, "-S", "-c", _PROGRAM, str(read_fd), *paths], pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except OSError:
            self._proc = None  # no watcher: a later agent on this machine cleans up instead
        finally:
            os.close(read_fd)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self, timeout_s: float = 2.0) -> None:
        """The agent removed its directories: let the watcher go, and reap it."""
        if self._write_fd >= 0:
            os.close(self._write_fd)
            self._write_fd = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
