"""Bounding text that a worker controls (exception messages, tracebacks, error files, stderr)
before it travels: a mesh message has a size limit (``proto.messages.MAX_MESSAGE_BYTES``), a
console line should be read by a person, and a 5 MB exception message must not stop a job."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# Per field of a fault report: enough for any real traceback, far below the mesh's limit even
# for every rank of a large node together.
FAULT_FIELD_LIMITS: Mapping[str, int] = {"message": 16_000, "traceback": 64_000, "stderr_tail": 16_000,
                                         "summary": 2_000, "error_type": 200}
LINE_LIMIT = 500  # what a console line shows of a worker's message
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters but tab and newline shown as escapes (``\\x1b``):
    a worker's message in unicron's own lines must not recolour the terminal or ring its bell."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text.replace("\r\n", "\n"))


def clip(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its head and tail with the count
    of what was left out between them (a traceback's last lines name the error)."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]} ... [{len(text) - limit} characters left out] ... {text[len(text) - tail:]}"


_WRAPPED = "Original Traceback (most recent call last):"


def first_line(text: str) -> str:
    """The first line of ``text`` that holds something (torch's own messages may start with a
    newline): what a one-line report shows of a multi-line message. An exception torch carried
    out of a DataLoader worker (``Caught E in DataLoader worker process N.``, the worker's
    traceback, its last line ``E: message``) shows the worker's own line, which names the
    sample or file: "E: message (in DataLoader worker process N)"."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    if not lines:
        return ""
    return wrapped_origin(lines) or lines[0]


def with_type(error_type: str, detail: str) -> str:
    """``detail`` led by its exception type, once: a DataLoader worker's own line (``first_line``)
    names its type already."""
    if not detail:
        return error_type
    return detail if detail.startswith(f"{error_type}:") else f"{error_type}: {detail}"


def wrapped_origin(lines: list[str]) -> str | None:
    """The worker's own line of a message torch carried out of a DataLoader worker (its
    non-empty, stripped ``lines``), with where it came from; None for any other message."""
    if len(lines) > 2 and lines[1] == _WRAPPED and lines[0].startswith("Caught "):
        kind, _, where = lines[0].removeprefix("Caught ").removesuffix(".").partition(" in ")
        own = next((line for line in reversed(lines[2:]) if line == kind or line.startswith(f"{kind}:")), None)
        if own is not None:
            return f"{own} (in {where})" if where else own
    return None


def clip_line(value: object, limit: int = LINE_LIMIT) -> str:
    """What a console line shows of ``value`` (as text): at most ``limit`` characters of it."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


def clip_fields(record: dict[str, Any], limits: Mapping[str, int] = FAULT_FIELD_LIMITS) -> dict[str, Any]:
    """``record`` with each string field named in ``limits`` clipped to its limit (in place)."""
    for name, limit in limits.items():
        value = record.get(name)
        if isinstance(value, str):
            record[name] = clip(value, limit)
    return record
