"""The console tee: echoes the files workers write to the agent's console, from one thread.

It reads the files the worker writes (it never sits between the worker and its output), so a
slow console cannot block a worker, and a worker that dies has already put every byte it wrote
into the file: a follow's ``finish`` drains it to the end before following stops. Lines that
match ``--duplicate-stdout-filters`` (``-stderr-``) are also copied, prefixed, into the
attempt's shared ``filtered_stdout.log`` (``filtered_stderr.log``); see ``unicron.agent.logs``.
"""

from __future__ import annotations

import io
import re
import sys
import threading
from collections.abc import Callable
from typing import IO, Any, Protocol

from unicron.agent.logs import LineCopy, RankLogs, copied_lines
from unicron.consoleline import note_echoed

_LINE_END = re.compile(rb"\r\n|\r|\n")


# The longest line held back until its end comes; a longer one is shown in pieces, which another
# rank's lines may then split. A config or a metrics dict printed as one JSON line runs to
# hundreds of KB (acceptance 25B F2: cut at 64 KiB, two ranks' lines spliced); torchrun's ranks
# write to the console directly, in one piece. A rank holds at most this much per stream.
MAX_LINE_BYTES = 8 << 20
# How long ``sync`` waits for the echo to catch up: the agent's loop waits so before its own
# line about a rank, so it must stay short; a console this far behind shows the order it can.
SYNC_WAIT_S = 0.25
SYNC_READS = 64  # 64 KiB reads of one file per sync at most: a rank that writes faster is left to the next round

class Console(Protocol):
    """Where teed lines go: a text stream (sys.stdout) or a binary one."""

    def write(self, data: Any, /) -> Any: ...

    def flush(self) -> Any: ...


def write_to_console(stream: Console, data: bytes) -> None:
    """Write bytes to a text or binary stream, keeping order with what was written as text."""
    if isinstance(stream, (io.RawIOBase, io.BufferedIOBase)):
        stream.write(data)
        stream.flush()
        return
    raw = getattr(stream, "buffer", None)
    if raw is not None:
        stream.flush()
        raw.write(data)
        raw.flush()
    else:
        stream.write(data.decode("utf-8", errors="replace"))
        stream.flush()


class _Follow:
    """One file being echoed: where it is read up to, and the unfinished last line."""

    def __init__(self, path: str, prefix: bytes, sink: Console, copy: LineCopy | None = None,
                 raw: bool = False) -> None:
        self.path = path
        self.prefix = prefix
        self.raw = raw  # echoed byte for byte as it comes, partial lines included (not teed: the worker's own stream)
        self.sink = sink
        self.copy = copy
        self.handle: IO[bytes] | None = None
        self.partial = bytearray()  # grown in place: a long line comes in many reads
        self.raw_held = bytearray()  # raw: an unfinished last line, shown once the writer pauses
        self.finished = False


class ConsoleTee:
    """Echoes log files to the console, each line prefixed, from one background thread.

    ``follow`` starts echoing a file; ``finish`` says its writer has exited, so the rest of the
    file is echoed (an unterminated last line gets a newline, unless raw) and following stops. ``close``
    finishes everything and waits for the thread. A follow with a ``LineCopy`` also appends its
    matching lines to that file, which stays open while any follow still copies into it.
    """

    def __init__(
        self,
        stdout: Console | None = None,
        stderr: Console | None = None,
        *,
        interval_s: float = 0.1,  # torchrun's tail interval: lines show as soon as under torchrun
        max_line_bytes: int = MAX_LINE_BYTES,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self.interval_s = interval_s
        self.max_line_bytes = max_line_bytes
        self._follows: list[_Follow] = []
        self._copies: dict[str, IO[bytes]] = {}  # LineCopy.path -> open file; used by the thread only
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.read_bytes = 0  # read from the files so far: how close() tells a backlog from a blocked console
        self._synced = threading.Condition(self._lock)
        self._sync_asked = 0  # syncs asked for, numbered ...
        self._sync_done = 0  # ... and the last one whose scan has ended
        self._sync_stuck_at: int | None = None  # read_bytes when a sync last gave up (a console that blocks)

    def follow(
        self, path: str, prefix: str, *, stream: str = "stdout", copy: LineCopy | None = None, raw: bool = False
    ) -> Callable[[], None]:
        """Echo ``path`` to the console's ``stream`` ("stdout"/"stderr"); returns its ``finish``.
        ``raw``: no prefix, and every byte shows as soon as it is read, an unfinished line (a
        progress bar's ``\r`` updates) too, as if the worker wrote to the console itself."""
        sink = (self._stderr or sys.stderr) if stream == "stderr" else (self._stdout or sys.stdout)
        entry = _Follow(path, b"" if raw else prefix.encode(), sink, copy, raw)
        with self._lock:
            if self._closing:
                raise RuntimeError("ConsoleTee is closed")
            self._follows.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="unicron-tee", daemon=True)
                self._thread.start()
        self._wake.set()

        def finish() -> None:
            entry.finished = True
            self._wake.set()

        return finish

    def follow_rank(self, logs: RankLogs) -> Callable[[], None]:
        """Follow whatever of this rank is teed; the returned callable finishes all of it."""
        finishers = []
        if logs.tee_stdout and logs.stdout_path:
            finishers.append(self.follow(logs.stdout_path, logs.prefix, stream="stdout", copy=logs.copy_stdout))
        if logs.tee_stderr and logs.stderr_path:
            finishers.append(self.follow(logs.stderr_path, logs.prefix, stream="stderr", copy=logs.copy_stderr,
                                         raw=not logs.stderr_prefixed))

        def finish_all() -> None:
            for finish in finishers:
                finish()

        return finish_all

    def sync(self, timeout_s: float = SYNC_WAIT_S) -> bool:
        """Echo what every followed file holds now (a finished one to its end) before returning:
        the agent calls it before its own line about a rank, so the rank's last words (an
        injected fault's notice, its traceback) come first on the console, not 0.1 s later
        (acceptance 33B F5). False if the echo did not catch up within ``timeout_s``; a console
        that took nothing since the last sync gave up is not waited for again."""
        with self._lock:
            if self._thread is None or not self._follows:
                return True
            if self._sync_stuck_at == self.read_bytes:
                return False
            self._sync_asked += 1
            asked = self._sync_asked
            self._wake.set()
            caught_up = self._synced.wait_for(lambda: self._sync_done >= asked, timeout_s)
            self._sync_stuck_at = None if caught_up else self.read_bytes
            return caught_up

    def pending(self) -> int:
        """Files still being followed."""
        with self._lock:
            return len(self._follows)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Echo what is left of every file and stop; False if some was left unshown. However far
        behind the echo is (ranks that logged hundreds of MB on a busy host), it goes on while
        it makes progress; only a console that takes nothing for ``timeout_s`` is left behind."""
        with self._lock:
            self._closing = True
            for entry in self._follows:
                entry.finished = True
            thread = self._thread
        self._wake.set()
        if thread is None:
            return True
        while True:
            before = self.read_bytes
            thread.join(timeout_s)
            if not thread.is_alive():
                return True
            if self.read_bytes == before:  # the console blocks: what is left stays in the files
                return False

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before the scan, so a wake during the scan is not lost
            with self._lock:
                follows = list(self._follows)
                closing = self._closing
                syncing = self._sync_asked  # asked before this scan: served by its end
            if not follows and closing:
                self._synced_up_to(syncing)
                return
            progressed = False
            for entry in follows:
                # Read "finished" before reading the file: a finish that lands after the read
                # is seen next round, so no byte written before finish is ever skipped.
                finished = entry.finished
                progressed |= self._pump(entry)
                if syncing > self._sync_done:  # to the file's end, as far as it was written before the sync
                    for _ in range(SYNC_READS):
                        if not self._pump(entry):
                            break
                if finished:
                    while self._pump(entry):
                        pass
                    self._flush_partial(entry)
                    self._drop(entry)
            self._synced_up_to(syncing)
            # Closing: every follow was finished, so this scan dropped them all; the next one
            # ends the thread. A wait here would hold close() for a round (one that came while
            # the thread was mid-scan: its wake was cleared before the scan saw it).
            if not progressed and not closing:
                self._wake.wait(self.interval_s)

    def _synced_up_to(self, asked: int) -> None:
        if asked > self._sync_done:
            with self._lock:
                self._sync_done = asked
                self._synced.notify_all()

    def _pump(self, entry: _Follow) -> bool:
        """Echo the complete lines now in the file; True if anything was read."""
        if entry.handle is None:
            try:
                entry.handle = open(entry.path, "rb")
            except OSError:
                return False
        data = entry.handle.read(1 << 16)
        self.read_bytes += len(data)
        if not data:
            if entry.raw_held:  # the writer paused mid-line (a prompt, a progress bar): show it now
                self._emit(entry, bytes(entry.raw_held))
                entry.raw_held = bytearray()
            return False
        if b"\n" not in data and b"\r" not in data and not entry.partial.endswith(b"\r"):
            return self._extend_line(entry, data)
        if entry.raw:
            # Up to the last line end only: another rank's output (or unicron's own line) must not
            # land inside this line, between two reads of it or two writes of one print.
            chunk = bytes(entry.raw_held) + data
            end = max(chunk.rfind(b"\n"), chunk.rfind(b"\r")) + 1
            if len(chunk) - end > self.max_line_bytes:
                end = len(chunk)  # a line with no end in sight is shown in pieces
            entry.raw_held = bytearray(chunk[end:])
            if end:
                self._emit(entry, chunk[:end])
        buffered = bytes(entry.partial) + data
        held = b""
        if buffered.endswith(b"\r"):  # maybe half of a \r\n: decided with the next read
            buffered, held = buffered[:-1], b"\r"
        # \r\n, \r and \n each end a line, as in torchrun's text-mode tail: a progress bar's
        # updates become prefixed lines of their own.
        lines = _LINE_END.split(buffered)
        entry.partial = bytearray(lines.pop() + held)
        cut = b""
        if len(entry.partial) > self.max_line_bytes:
            # A line with no newline in sight (a progress bar with \r) is shown in pieces.
            cut, entry.partial = bytes(entry.partial), bytearray()
        shown = lines + [cut] if cut else lines
        if shown:
            if not entry.raw:
                self._emit(entry, b"".join(entry.prefix + line + b"\n" for line in shown))
            self._copy(entry, lines)
            self._copy(entry, [cut] if cut else [], terminated=False)
        return True

    def _extend_line(self, entry: _Follow, data: bytes) -> bool:
        """``data`` ends no line: it only lengthens the one held, in place (acceptance 33A F7:
        joining and re-scanning the whole held line at every 64 KiB read was quadratic, a 32 MiB
        line kept the launcher 8 s past the job's end)."""
        if entry.raw:
            entry.raw_held += data
            if len(entry.raw_held) > self.max_line_bytes:  # a line with no end in sight: in pieces
                self._emit(entry, bytes(entry.raw_held))
                entry.raw_held = bytearray()
        entry.partial += data
        if len(entry.partial) > self.max_line_bytes:
            cut = bytes(entry.partial)
            entry.partial = bytearray()
            if not entry.raw:
                self._emit(entry, entry.prefix + cut + b"\n")
            self._copy(entry, [cut], terminated=False)
        return True

    def _flush_partial(self, entry: _Follow) -> None:
        if entry.raw_held:
            self._emit(entry, bytes(entry.raw_held))
            entry.raw_held = bytearray()
        if entry.partial:
            partial = bytes(entry.partial)
            if not entry.raw:  # raw: shown already, and the worker chose not to end the line
                self._emit(entry, entry.prefix + partial.removesuffix(b"\r") + b"\n")
            self._copy(entry, [partial], terminated=False)
            entry.partial = bytearray()

    def _copy(self, entry: _Follow, lines: list[bytes], *, terminated: bool = True) -> None:
        copy = entry.copy
        if copy is None or not lines:
            return
        data = b"".join(entry.prefix + piece.encode() + b"\n"
                        for line in lines for piece in copied_lines(line, copy.needles, terminated=terminated))
        if not data:
            return
        try:
            handle = self._copies.get(copy.path)
            if handle is None:
                # Append: a copy closed while no rank followed it may be reopened by a later rank.
                handle = self._copies[copy.path] = open(copy.path, "ab")
            handle.write(data)
            handle.flush()
        except OSError:
            pass  # a full disk or removed directory must not stop the agent; the rank's own file has it all

    def _emit(self, entry: _Follow, data: bytes) -> None:
        try:
            write_to_console(entry.sink, data)
            if entry.raw:
                note_echoed(data)
        except (OSError, ValueError):
            # A closed console (``unicron run | head``) must not stop the agent; the file keeps it all.
            pass

    def _drop(self, entry: _Follow) -> None:
        if entry.handle is not None:
            entry.handle.close()
        with self._lock:
            if entry in self._follows:
                self._follows.remove(entry)
            path = entry.copy.path if entry.copy is not None else None
            if path is not None and any(f.copy is not None and f.copy.path == path for f in self._follows):
                path = None  # another rank still copies into the same file
        handle = self._copies.pop(path, None) if path is not None else None
        if handle is not None:
            handle.close()
