"""The workers' rendezvous store: a fresh TCPStore per attempt (shell).

A restarted worker must never read the keys of the attempt before it (torchrun's restarts can),
so every attempt gets a store of its own. Opening one imports torch and binds a port, which
can take seconds on a loaded host: it is done on a thread of its own, and the coordinator's
loop, which must keep answering heartbeats meanwhile, collects what is ready.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

STORE_TRIES = 3  # attempts at opening an attempt's TCPStore
STORE_OPEN_TIMEOUT_S = 30.0  # each one's bound


class StoreOpener:
    """Opens stores off the caller's thread; ``ready()`` hands over what opened (or failed)."""

    def __init__(self) -> None:
        self._ready: queue.Queue[tuple[str, int, Any, str]] = queue.Queue()

    def open(self, job_id: str, attempt: int) -> None:
        threading.Thread(target=self._open, args=(job_id, attempt), name="unicron-store", daemon=True).start()

    def pending(self) -> bool:
        """Something opened that ``ready()`` has not handed over yet."""
        return not self._ready.empty()

    def ready(self) -> list[tuple[str, int, Any, str]]:
        """(job id, attempt, store or None, why it could not be opened) for each store done."""
        done = []
        while True:
            try:
                done.append(self._ready.get_nowait())
            except queue.Empty:
                return done

    def _open(self, job_id: str, attempt: int) -> None:
        error = ""
        for _ in range(STORE_TRIES):
            try:
                from torch.distributed import TCPStore

                # Its own client connects to it at once: a bounded wait (torch's default is 300 s,
                # and the job would wait that long without a word), then a fresh port.
                store = TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=STORE_OPEN_TIMEOUT_S),
                                 wait_for_workers=False)
            except Exception as err:  # noqa: BLE001 - reported as the job's failure, in the loop thread
                error = str(err)
                continue
            self._ready.put((job_id, attempt, store, ""))
            return
        self._ready.put((job_id, attempt, None, f"cannot open the workers' store: {error}"))


def preload() -> None:
    """Import torch's store on a thread now, off the critical path: the first attempt needs it."""
    threading.Thread(target=_import_store, name="unicron-preload", daemon=True).start()


def _import_store() -> None:
    try:
        import torch.distributed  # noqa: F401
    except Exception:  # the attempt itself will report a broken torch install
        pass
