"""The store host: the workers' TCPStores, served by a fork of the zygote (shell, plus its pure protocol).

The embedded coordinator opens a fresh TCPStore for every attempt (``unicron.coord.stores``).
Opening one needs torch, and importing torch in the launcher costs about 2 s of CPU at every
job's start and hundreds of MB for the launcher's life, though the node's zygote has torch
imported already. So the zygote, once its imports are done and before it says ready (while it
still has one thread), forks a store host: a process re-parented to the agent, in a session
of its own (killing a zygote leaves it be), that dies with the agent (PDEATHSIG). The
coordinator talks to it over two pipes (``StoreHostChannel`` in ``unicron.coord.stores``), one
JSON line each way:

    {"open": ID, "timeout_s": T}   ->  {"id": ID, "port": P}  or  {"id": ID, "error": "..."}
    {"close": ID}                  ->  (nothing)

End of input (the coordinator gone, the agent closing its pool) makes it exit 0. The pipes
never leave the node (they are not the mesh), but a request is still checked before use.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from unicron.worker.jsonlines import LineReader, read_object, write_object

MAX_TIMEOUT_S = 3600.0


class RequestError(ValueError):
    """A request line that is not one of the two forms above."""


def parse_request(line: bytes) -> tuple[str, int, float]:
    """("open", id, timeout_s) or ("close", id, 0.0); raises RequestError (pure)."""
    request = read_object(line, "request", RequestError)
    for kind in ("open", "close"):
        ident = request.get(kind)
        if ident is None:
            continue
        if not isinstance(ident, int) or isinstance(ident, bool) or ident < 0:
            raise RequestError(f"{kind}: the id must be a non-negative integer")
        if kind == "close":
            return kind, ident, 0.0
        timeout = request.get("timeout_s", 30.0)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= MAX_TIMEOUT_S:
            raise RequestError(f"open: timeout_s must be a number in (0, {MAX_TIMEOUT_S:g}]")
        return kind, ident, float(timeout)
    raise RequestError("request is neither open nor close")


def open_tcp_store(timeout_s: float, port: int = 0) -> Any:
    """A TCPStore server on ``port`` (0: a free one) of every interface. Its own client connects
    at once: a bounded wait (torch's default is 300 s, and a job would wait that long without a
    word)."""
    from torch.distributed import TCPStore

    return TCPStore("0.0.0.0", port, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def serve(requests_fd: int, replies_fd: int) -> int:
    """Open and close stores as asked until end of input; returns the exit code (0)."""
    stores: dict[int, Any] = {}
    requests = LineReader(requests_fd)
    while (line := requests.next_line()) is not None:
        try:
            kind, ident, timeout_s = parse_request(line)
        except RequestError as err:
            write_object(replies_fd, {"error": str(err)})
            continue
        if kind == "close":
            stores.pop(ident, None)  # its destructor stops the server and frees the port
            continue
        try:
            store = open_tcp_store(timeout_s)  # torch is imported already: this is a fork of the zygote
        except Exception as err:  # noqa: BLE001 - the coordinator reports it as the attempt's failure
            write_object(replies_fd, {"id": ident, "error": f"{type(err).__name__}: {err}"})
            continue
        stores[ident] = store
        if not write_object(replies_fd, {"id": ident, "port": int(store.port)}):
            return 0  # nobody reads: the coordinator is gone
    return 0
