"""One-shot request/reply to a coordinator (used by `unicron status`)."""

from __future__ import annotations

import os
from typing import Any

import zmq

from unicron.errors import EndpointUnreachableError, ProtocolError, UsageError
from unicron.proto.messages import Codec, Message


def tcp_endpoint(endpoint: str) -> str:
    """``host:port`` -> ``tcp://host:port`` (IPv6 literals in brackets pass through)."""
    if endpoint.startswith(("tcp://", "ipc://")):
        return endpoint
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise UsageError(f"bad endpoint {endpoint!r}: expected HOST:PORT")  # bad input, not a silent peer
    if not 0 < int(port) <= 65535:
        raise UsageError(f"bad endpoint {endpoint!r}: port must be 1..65535")
    return f"tcp://{host}:{port}"


def request(
    endpoint: str,
    kind: str,
    body: dict[str, Any],
    *,
    job: str,
    key: bytes,
    timeout_s: float = 3.0,
    expect: str | None = None,
) -> Message:
    """Send one signed message and wait for one signed reply, or raise within ``timeout_s``.

    Never hangs: the socket has no linger and every wait is bounded.
    """
    codec = Codec(key, f"client-{os.getpid()}-{os.urandom(4).hex()}", job=job, follows_clock=True)
    ctx: zmq.Context = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IPV6, 1)  # an IPv6 literal endpoint needs it; IPv4 ones are unaffected
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(tcp_endpoint(endpoint))
        sock.send(codec.encode(kind, body))
        resent = False
        deadline_ms = int(timeout_s * 1000)
        while True:
            if not sock.poll(deadline_ms, zmq.POLLIN):
                raise EndpointUnreachableError(f"no answer from {endpoint} within {timeout_s:g} s")
            raw = sock.recv()
            try:
                msg = codec.decode(raw)
            except ProtocolError as err:
                raise EndpointUnreachableError(f"bad answer from {endpoint}: {err}") from None
            if msg.kind == "reject" and "clock" in msg.body and not resent:  # ask again in its time
                resent = True
                sock.send(codec.encode(kind, body))
                continue
            if expect is None or msg.kind == expect:
                return msg
            if msg.kind == "reject":
                raise EndpointUnreachableError(f"{endpoint} refused: {msg.body.get('reason')}")
    finally:
        sock.close(0)
