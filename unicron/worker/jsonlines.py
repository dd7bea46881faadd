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
