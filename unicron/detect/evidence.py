"""What a classifier rule looks at: one fault's text boiled down once (the final exception,
its message, the error text without quoted source lines, the signal it died of) and the health
readings of its node near its time. Pure."""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass

from unicron.detect.faults import Fault, stderr_summary
from unicron.textclip import with_type, wrapped_origin

# Health faults this close (seconds) to a worker fault on the same node are evidence about it.
HEALTH_EVIDENCE_WINDOW_S = 30.0

_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning))(?::\s*(.*))?$", re.MULTILINE
)
# torch (and torchrun --tee) prefix every line a rank writes with "[rank0]: " / "[default0]:".
_LINE_PREFIX = re.compile(r"^\[[\w.\-]{1,40}\]:[ ]?", re.MULTILINE)
_TRACEBACK_START = re.compile(r'^(?:Traceback\b|\s*File "[^"]*", line \d+)')
# How CPython joins a chain's tracebacks (raise ... from, an exception while handling another).
_CHAINED = re.compile(r"^(?:During handling of the above exception|The above exception was the direct cause)")
FRAME_FILE = re.compile(r'^\s*File "([^"]+)", line \d+', re.MULTILINE)
_FRAME_LINE = re.compile(r'^(\s*)File "[^"]*", line \d+')
# What a process may still print after the line it failed on: unicron's hooks' own warnings,
# glog's W/I lines and Python warnings at interpreter teardown (bare, or as the warnings module
# prints them: "sys:1: ResourceWarning: unclosed file ...").
AFTERWORDS = re.compile(r"^(?:unicron: |\[?[WI]\d{4}\b|\S*Warning: |\S+:\d+: \w*Warning: )")
# The warnings module prints the warning's source line, indented, under "file:N: XWarning: msg".
_WARNING_AT = re.compile(r"^\S+:\d+: \w*Warning: ")


def drop_afterwords(lines: list[str]) -> list[str]:
    """``lines`` (a process's last ones, rstripped) without what it printed after the line it
    failed on (``AFTERWORDS``, and a warning's quoted source line: 35A F5, an atexit warning
    hid the exception under ``--no-inject``); an exception's own line is never dropped."""
    while lines:
        if AFTERWORDS.match(lines[-1]) and not _EXCEPTION_LINE.fullmatch(lines[-1]):
            lines.pop()
        elif len(lines) > 1 and lines[-1][:1].isspace() and _WARNING_AT.match(lines[-2]):
            del lines[-2:]
        else:
            break
    return lines


@dataclass(frozen=True)
class Evidence:
    """What every rule may look at, computed once per fault."""

    text: str  # error_type, message, traceback and stderr tail, joined
    exception_type: str  # short name of the final exception ("" if none)
    exception_message: str
    signal: int | None  # resolved from signal, a negative exit code, or a 128+n exit code
    health: tuple[Fault, ...]  # health faults on the same node near the fault's time


def signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def resolve_signal(fault: Fault) -> int | None:
    if fault.signal is not None:
        return fault.signal
    code = fault.exitcode
    if code is None:
        return None
    if code < 0:
        return -code  # subprocess.Popen's convention
    if 128 < code <= 128 + 64:
        return code - 128  # a shell (or torchrun's error file) reports death by signal n as 128+n
    return None


def strip_prefixes(text: str) -> str:
    return _LINE_PREFIX.sub("", text)


def without_source(text: str) -> str:
    """A traceback without the source lines (and ``^^^`` markers) it quotes under each frame.

    The rules look for error text; a script's own code is not evidence. A comment or a string
    literal such as ``# avoid a device-side assert`` in a quoted line must not make an
    ordinary ValueError a CUDA error.
    """
    out: list[str] = []
    frame_indent: int | None = None
    for line in text.splitlines():
        found = _FRAME_LINE.match(line)
        if found:
            frame_indent = len(found.group(1))
        elif frame_indent is not None and line.strip() and len(line) - len(line.lstrip()) > frame_indent:
            continue  # quoted source of the frame above
        else:
            frame_indent = None
        out.append(line)
    return "\n".join(out)


def ending_exception(text: str) -> tuple[str, str] | None:
    """The exception a traceback in ``text`` ends on, if ``text`` ends on it: its ``XError: msg``
    line is the last line, but for what a process prints after it failed (``AFTERWORDS``). In a
    chain (``During handling of the above exception ...``) that is the last one, the one that
    ended the process. A traceback the script caught and printed, then carried on (``optional
    feature unavailable, continuing``) and exited for another reason, is not it (acceptance 34A
    F1: an optional import's ModuleNotFoundError made a later ``sys.exit(1)`` FATAL). A message
    over several lines is not recognised: the fault is then an exit with its code."""
    lines = [line.rstrip() for line in strip_prefixes(text).splitlines() if line.strip()]
    drop_afterwords(lines)
    found = _EXCEPTION_LINE.fullmatch(lines[-1]) if lines else None
    # ... of a traceback: its header, or a frame (CPython prints a SyntaxError in the script it
    # was given as its frame alone); a log line "OutOfMemoryError: retrying" alone is none.
    if found is None or not any(_TRACEBACK_START.match(line) for line in lines[:-1]):
        return None
    return found.group(1).rsplit(".", 1)[-1], (found.group(2) or "").strip()


def final_traceback(text: str) -> str:
    """The last traceback in ``text``, with the exceptions chained before it (``During handling
    of the above exception ...``): not one printed earlier that the script caught and went on
    from. All of ``text`` when it holds no traceback header."""
    lines = strip_prefixes(text).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if not starts:
        return "\n".join(lines)
    k = len(starts) - 1
    while k > 0 and any(_CHAINED.match(line) for line in lines[starts[k - 1]:starts[k]]):
        k -= 1
    return "\n".join(lines[starts[k]:])


def final_exception(fault: Fault) -> tuple[str, str]:
    """The exception that ended the process: the one its hooks forwarded, else the one a
    traceback in its error file or stderr ends on (``ending_exception``)."""
    if fault.error_type:
        return fault.error_type.rsplit(".", 1)[-1], fault.message
    if fault.sys_exit:  # left through sys.exit: a traceback it printed before is not its end (35A F1)
        return "", fault.message
    for text in (fault.traceback, fault.stderr_tail):
        found = ending_exception(text)
        if found:
            return found
    return "", fault.message


def gather(fault: Fault, health: Sequence[Fault]) -> Evidence:
    exc_type, exc_msg = final_exception(fault)
    parts = (fault.error_type, fault.message, without_source(fault.traceback),
             without_source(strip_prefixes(fault.stderr_tail)))
    text = "\n".join(p for p in parts if p)
    near = tuple(
        h
        for h in health
        if h.kind == "health"
        and abs(h.ts - fault.ts) <= HEALTH_EVIDENCE_WINDOW_S
        and (h.node == fault.node or h.host and h.host == fault.host)
    )
    return Evidence(text, exc_type, exc_msg, resolve_signal(fault), near)


def short(text: str, limit: int = 200) -> str:
    # Lines end at "\n" only: a "\r" (a progress-style message) is part of the line, shown escaped.
    # A DataLoader worker's error carried out by torch shows the worker's own line (the sample).
    line = wrapped_origin([s.strip() for s in text.split("\n") if s.strip()]) \
        or (text.strip().split("\n")[0].rstrip("\r") if text.strip() else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def error_summary(fault: Fault, ev: Evidence) -> str:
    if ev.exception_type:
        return with_type(ev.exception_type, short(ev.exception_message))
    return short(fault.message) or short(stderr_summary(strip_prefixes(fault.stderr_tail)))
