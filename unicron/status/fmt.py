"""Small value formatters for the status views: durations, ages, sizes, sparklines, and one-line
renderings of any JSON value. Pure; every input may be missing or of an odd type (it came over
the network), and the output degrades to "-" instead of raising."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from unicron.textclip import printable

SPARK_CHARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 12
# Fields every event carries that the "details" column need not repeat.
EVENT_HEADER_FIELDS = ("ts", "kind", "job")
DETAIL_FIRST = ("rank", "ranks", "fault_kind", "action", "severity", "exitcode", "signal", "error_type", "message",
                "reason", "cause", "attempt", "step", "restore_step", "exit_code")


NUMBER_LIMIT = 1e18


def plausible(value: Any) -> Any:
    """``value`` (a status snapshot) with every number no coordinator sends (non-finite, or past
    ``NUMBER_LIMIT``) as None: the views print many fields as they come (an attempt number of
    400 digits filled the header: 30B F6)."""
    if isinstance(value, dict):
        return {k: plausible(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plausible(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value if num(value) is not None else None
    return value


def num(value: Any) -> float | None:
    """A finite number from a JSON value, or None (bool is not a number here). NaN and infinities
    (Python's JSON reads them) are None too: every view does int() or arithmetic on what this
    returns, and int(inf) raised."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # an integer past 1.8e308
        return None
    # Past 1e18 no count, step, time or size a coordinator sends: a hostile one's 1e308 printed
    # as a 309-digit count that pushed the nodes table's columns out (acceptance 30B F6).
    return out if math.isfinite(out) and abs(out) <= NUMBER_LIMIT else None


def fmt_duration(seconds: float | None) -> str:
    """Compact duration: 0.4s, 12s, 3m05s, 2h10m, 3d04h."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s < 86400 * 100_000:
        return f"{s // 86400}d{s % 86400 // 3600:02d}h"
    return f"{seconds / 86400:.3g}d"  # a nonsense time stays a short token, not 300 digits


def fmt_age(ts: Any, now: float) -> str:
    """How long ago ``ts`` was; "-" for a missing or zero timestamp."""
    t = num(ts)
    if not t:
        return "-"
    return fmt_duration(now - t)


def fmt_iter_time(seconds: Any) -> str:
    s = num(seconds)
    if s is None:
        return "-"
    if s < 1:
        return f"{s * 1000:.0f}ms" if s >= 0.01 else f"{s * 1000:.1f}ms"
    return f"{s:.2f}s"


def fmt_bytes(n: Any) -> str:
    value = num(n)
    if value is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{value:.0f}{unit}" if unit == "B" or value >= 10 else f"{value:.1f}{unit}"
        value /= 1024
    return "-"  # unreachable; keeps mypy happy


def sparkline(values: Iterable[Any], width: int = SPARK_WIDTH) -> str:
    """Block-character sparkline of the last ``width`` numbers, scaled between their min and max."""
    nums = [v for v in (num(x) for x in values) if v is not None][-width:]
    if not nums:
        return ""
    lo, hi = min(nums), max(nums)  # within +-NUMBER_LIMIT (``num``): hi - lo cannot overflow
    if hi - lo <= 1e-12:
        return SPARK_CHARS[len(SPARK_CHARS) // 2 - 1] * len(nums)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - lo) / (hi - lo) * top)] for v in nums)


def short_value(value: Any, limit: int = 48) -> str:
    """One-line rendering of any JSON value for a details column."""
    if isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, list):
        text = ",".join(short_value(v, 12) for v in value[:6]) + (",…" if len(value) > 6 else "")
        text = f"[{text}]"
    elif isinstance(value, dict):
        text = "{" + " ".join(f"{k}={short_value(v, 12)}" for k, v in list(value.items())[:4])
        text += " …}" if len(value) > 4 else "}"
    else:
        text = str(value)
    # Tracebacks and messages stay on one line; a worker's control characters (a terminal escape
    # in an exception's message) are shown, not obeyed: they would clear or recolour the view.
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def event_details(event: Mapping[str, Any], *, skip: Iterable[str] = EVENT_HEADER_FIELDS, limit: int = 48) -> str:
    """``key=value`` pairs of an event beyond its header fields, the telling ones first
    (a narrow column cuts the end), the emitting host last; each value cut at ``limit``."""
    skipped = set(skip)
    keys = [k for k in event if k not in skipped]
    keys.sort(key=lambda k: (DETAIL_FIRST.index(k) if k in DETAIL_FIRST else len(DETAIL_FIRST), k == "node"))
    return " ".join(f"{k}={_detail(k, event, limit)}" for k in keys)


def _detail(key: str, event: Mapping[str, Any], limit: int = 48) -> str:
    """A time of day (``occurred_at``, ``last_step_at``: epoch seconds, which ``.4g`` would show
    as 1.797e+09) as its offset from the event's own time, which is what it tells."""
    value, ts = event[key], num(event.get("ts"))
    if key.endswith("_at") and type(value) in (int, float) and ts is not None and abs(value - ts) < 1e6 \
            and value > 1e8:
        return f"{value - ts:+.3f}s"
    return short_value(value, limit)
