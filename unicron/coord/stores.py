"""The workers' rendezvous store: a fresh TCPStore per attempt (shell).

A restarted worker must never read the keys of the attempt before it (torchrun's restarts can),
so every attempt gets a store of its own. Opening one can take seconds (on a loaded host, or
while the node's zygote still imports): it is done on a thread of its own, and the
coordinator's loop, which must keep answering heartbeats meanwhile, collects what is ready.

Where the coordinator is embedded in an agent with warm workers, the stores live in the store
host the agent's zygote forked (``unicron.worker.storehost``), which has torch imported
already, so the launcher never imports torch. Otherwise (a standalone coordinator,
``--no-warm``, a store host that is gone) they are opened here, importing torch on a thread.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import threading
import time
from typing import Any, Protocol

from unicron.worker.jsonlines import read_object
from unicron.worker.storehost import open_tcp_store

STORE_TRIES = 3  # attempts at opening an attempt's TCPStore
STORE_OPEN_TIMEOUT_S = 30.0  # each one's bound
# A store host is forked once the zygote's imports are done: as long as an attempt waits for a
# zygote still importing (``unicron.agent.warm.READY_WAIT_S``); then stores open here.
HOST_WAIT_S = 300.0
# Once it has answered, it has imported what it needs and opens a store in milliseconds: a host
# silent this long is stopped or wedged (SIGSTOP, a frozen cgroup), and the attempt waited 300 s
# in silence for it (acceptance 21A F2).
ANSWERED_WAIT_S = 10.0

log = logging.getLogger(__name__)


class Store(Protocol):
    """An attempt's store as the coordinator holds it: where it listens, and a way to end it."""

    port: int

    def close(self) -> None: ...


class LocalStore:
    """A TCPStore opened in this process."""

    def __init__(self, store: Any) -> None:
        self._store: Any = store
        self.port = int(store.port)

    def close(self) -> None:
        self._store = None  # its destructor stops the server and frees the port


class StoreHostGone(Exception):
    """The store host cannot be used (it exited, or never came): stores open here instead."""


class StoreOpenError(Exception):
    """The store host is there but could not open this store."""


class HostedStore:
    """A TCPStore in the store host."""

    def __init__(self, channel: StoreHostChannel, ident: int, port: int) -> None:
        self._channel, self.ident, self.port = channel, ident, port
        self._closed = False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._channel.close_store(self.ident)


class StoreHostChannel:
    """The coordinator's end of the two pipes to a store host (the protocol is in
    ``unicron.worker.storehost``). Opens are taken one at a time; a close is one short write
    (atomic on a pipe), so the coordinator's loop never waits behind an open."""

    def __init__(self, requests_fd: int, replies_fd: int) -> None:
        self._requests, self._replies = requests_fd, replies_fd
        os.set_blocking(replies_fd, False)
        self._reading = threading.Lock()  # one open at a time waits for its answer
        self._writing = threading.Lock()  # short: a write of one line, or the close
        self._buffer = b""
        self._next_id = 0
        self.gone: str | None = None  # why it cannot be used any more
        self.answered = False  # it answered an open: it is past its imports

    def open(self, timeout_s: float, wait_s: float) -> HostedStore:
        """A fresh store whose own client waits ``timeout_s`` at most; the host's answer is
        waited for ``wait_s``. Raises StoreHostGone or StoreOpenError."""
        with self._reading:
            if self.gone is not None:
                raise StoreHostGone(self.gone)
            ident, self._next_id = self._next_id, self._next_id + 1
            self._send({"open": ident, "timeout_s": timeout_s})
            deadline = time.monotonic() + wait_s
            while True:
                reply = self._next_reply(deadline)
                self.answered = True
                if reply.get("id") == ident:
                    port = reply.get("port")
                    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                        return HostedStore(self, ident, port)
                    raise StoreOpenError(str(reply.get("error", "the store host sent no port")))
                if isinstance(reply.get("id"), int) and "port" in reply:
                    self.close_store(reply["id"])  # opened for an open that gave up waiting

    def close_store(self, ident: int) -> None:
        try:
            self._send({"close": ident})
        except StoreHostGone:
            pass  # gone with the host already

    def close(self) -> None:
        """End the host (its end of input); a reader waiting on it then sees it gone."""
        with self._writing:
            fd, self._requests = self._requests, -1
            if fd >= 0:
                os.close(fd)

    def _send(self, message: dict[str, Any]) -> None:
        with self._writing:
            if self._requests < 0:
                why = "the coordinator closed it"
            else:
                try:
                    os.write(self._requests, json.dumps(message).encode() + b"\n")
                    return
                except OSError as err:  # BrokenPipeError: it exited
                    why = f"the store host is gone ({err.strerror})"
        self._lose(why)

    def _next_reply(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._lose("the store host did not answer")  # a zygote stuck importing
            if select.select([self._replies], [], [], min(remaining, 1.0))[0]:
                try:
                    data = os.read(self._replies, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    self._lose("the store host exited")
                self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return read_object(line, "reply", ValueError)
        except ValueError:
            return {}

    def _lose(self, why: str) -> None:
        if self.gone is None:
            self.gone = why
            log.info("%s: opening the workers' stores in the launcher", why)
        raise StoreHostGone(why)


class AttemptStores:
    """The stores a job holds: the current attempt's and the one before (a node that has not
    heard of the new attempt yet may still read it), the older ones closed."""

    def __init__(self) -> None:
        self._by_attempt: dict[int, Store] = {}

    def keep(self, attempt: int, store: Store) -> None:
        self._by_attempt[attempt] = store
        for old in [a for a in self._by_attempt if a < attempt - 1]:
            self._by_attempt.pop(old).close()

    def close_all(self) -> None:
        while self._by_attempt:
            self._by_attempt.popitem()[1].close()

    def __len__(self) -> int:
        return len(self._by_attempt)


class StoreOpener:
    """Opens stores off the caller's thread; ``ready()`` hands over what opened (or failed)."""

    def __init__(self, host: StoreHostChannel | None = None) -> None:
        self._ready: queue.Queue[tuple[str, int, Store | None, str]] = queue.Queue()
        self.host = host

    def open(self, job_id: str, attempt: int, port: int = 0) -> None:
        """A store on any free port, or on ``port`` (one a coordinator before this one held)."""
        threading.Thread(target=self._open, args=(job_id, attempt, port), name="unicron-store", daemon=True).start()

    def pending(self) -> bool:
        """Something opened that ``ready()`` has not handed over yet."""
        return not self._ready.empty()

    def ready(self) -> list[tuple[str, int, Store | None, str]]:
        """(job id, attempt, store or None, why it could not be opened) for each store done."""
        done = []
        while True:
            try:
                done.append(self._ready.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        if self.host is not None:
            self.host.close()

    def _open(self, job_id: str, attempt: int, port: int) -> None:
        error = ""
        for _ in range(STORE_TRIES):
            try:
                store = self._open_once(port)
            except Exception as err:  # noqa: BLE001 - reported as the job's failure, in the loop thread
                error = str(err)
                continue
            self._ready.put((job_id, attempt, store, ""))
            return
        self._ready.put((job_id, attempt, None, f"cannot open the workers' store: {error}"))

    def _open_once(self, port: int) -> Store:
        if self.host is not None and not port:  # the store host opens on a free port only
            try:
                return self.host.open(STORE_OPEN_TIMEOUT_S, ANSWERED_WAIT_S if self.host.answered else HOST_WAIT_S)
            except StoreHostGone:
                pass
        return LocalStore(open_tcp_store(STORE_OPEN_TIMEOUT_S, port))  # imports torch here: the first time, seconds


def preload() -> None:
    """Import torch's store on a thread now, off the critical path: the first attempt needs it."""
    threading.Thread(target=_import_store, name="unicron-preload", daemon=True).start()


def _import_store() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # the attempt itself will report a broken torch install
        pass
