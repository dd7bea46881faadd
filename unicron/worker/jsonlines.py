"""One JSON object per line over a pipe: how the zygote and the store host talk to the agent."""

from __future__ import annotations

import json
import os
from typing import Any


def read_object(line: bytes, what: str, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object on ``line``; raises ``error`` naming ``what`` when it is not one (pure)."""
    try:
        value = json.loads(line)
    except ValueError as err:
        raise error(f"{what} is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise error(f"{what} is not an object")
    return value


def write_object(fd: int, message: dict[str, Any]) -> bool:
    """One JSON line to ``fd``; False when nobody reads any more."""
    try:
        os.write(fd, json.dumps(message).encode() + b"\n")
        return True
    except OSError:
        return False


class LineReader:
    """Lines from a pipe, read with ``os.read`` (no buffered object a forked worker could inherit)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""

    def next_line(self) -> bytes | None:
        """The next line without its newline; None at end of input (a last unterminated line counts)."""
        while b"\n" not in self.buffer:
            data = os.read(self.fd, 1 << 16)
            if not data:
                line, self.buffer = self.buffer, b""
                return line or None
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line
