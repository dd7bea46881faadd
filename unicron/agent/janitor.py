"""A watcher that removes the agent's directories when the agent dies without doing it.

The agent removes its shared-memory snapshot directory and its IPC directory on every path it
controls. A SIGKILL, the kernel's OOM killer or a crash gives it
no such path, and the snapshots (model and optimizer state, three steps of it per rank) would
hold that much RAM in ``/dev/shm`` until the next agent on the machine cleans up (``shm.py``).

The same deaths leave the workers' own children behind: the workers go with the agent
(PDEATHSIG), but what they started (a subprocess, a daemon in a session of its own) is
adopted by init and runs on. Every process started from a worker's environment carries the
agent's ``UNICRON_AGENT_ADDR`` (an IPC path unique to the agent), so the janitor kills those.
The zygote is started with it too: a warm worker's ``/proc/PID/environ``, and that of a child it
forks without exec, is the zygote's. A data loader's and a process pool's workers end by
themselves when their parent is gone.

So the agent starts this small process (``python -S``, a few standard modules: a few MB) with
the read end of a pipe. It waits for end of input, which comes when the agent closes the pipe
(it has removed the directories and stopped its workers by then, and says ``done`` first) or
dies (the kernel closes it, and nothing was said), and removes whatever of the directories is
still there and, after a death, kills the processes that carry the marker. It runs in a
session of its own, ignoring the terminal's signals, so a Ctrl-C that also reaches the agent
does not take it first, and the scripts' (SIGUSR1, SIGUSR2: Slurm signals every process of a
job step with them, acceptance 25A F3).
"""

from __future__ import annotations

import os
import subprocess
import sys

_PROGRAM = """
import os, shutil, signal, sys
for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)
fd, marker = int(sys.argv[1]), sys.argv[2].encode()
said = b""
try:
    while chunk := os.read(fd, 4096):
        said = (said + chunk)[-4:]
except OSError:
    pass
for path in sys.argv[3:]:
    shutil.rmtree(path, ignore_errors=True)
def marked():
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                entries = f.read().split(b"\\0")
        except OSError:
            continue
        if marker in entries:
            yield int(name)
for _ in range(5 if marker and said != b"done" else 0):  # again: one may have forked meanwhile
    found = False
    for pid in marked():
        found = True
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if not found:
        break
"""


class Janitor:
    def __init__(self, paths: list[str], python: str = sys.executable, marker: str = "") -> None:
        """``marker``: an environment entry (``NAME=value``) that only this agent's workers'
        processes carry; they are killed if the agent dies."""
        read_fd, self._write_fd = os.pipe()
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [python, "-S", "-c", _PROGRAM, str(read_fd), marker, *paths], pass_fds=(read_fd,),
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
        """The agent removed its directories and stopped its workers: let the watcher go, and
        reap it."""
        if self._write_fd >= 0:
            try:
                os.write(self._write_fd, b"done")  # a clean end: nothing to kill
            except OSError:
                pass
            os.close(self._write_fd)
            self._write_fd = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
