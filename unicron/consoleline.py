"""Whether unicron's next line on stderr must begin with a line end of its own.

The ranks' stderr is echoed byte for byte (``unicron.agent.tee``, raw streams): a progress bar's
``\\r`` update, a prompt, or a last line cut short (a full disk) leaves the console mid-line,
and unicron's own next line (a fault, ``unicron: error: ...``) was glued to its end.
"""

from __future__ import annotations

_mid_line = False


def note_echoed(data: bytes) -> None:
    """The raw echo wrote ``data`` to stderr."""
    global _mid_line
    if data:
        _mid_line = data[-1:] not in (b"\n",)


def line_start() -> str:
    """"\\n" when the console is mid-line (and it no longer is), else ""."""
    global _mid_line
    if not _mid_line:
        return ""
    _mid_line = False
    return "\n"
