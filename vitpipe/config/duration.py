"""Durations as configs write them (``trainer.time_budget``): ``30min``, ``2h``, ``1h30min``, ``90s``, seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(d|hr|h|min|m|sec|s)")
_VALID = "expected a duration such as 30min, 2h, 1h30min, 90s, or a number of seconds"


def parse_duration(value, key: str = "trainer.time_budget") -> float | None:
    """Seconds in ``value`` (``"30min"``, ``"2h"``, ``"1h30min"``, ``"90s"``, ``1800``); None for null."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and value.strip() and _PART.sub("", value.replace(" ", "")) == "":
        seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(value.replace(" ", "")))
    else:
        raise ValueError(f"{key}={value!r}: {_VALID}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{key}={value!r}: must be a positive duration ({_VALID})")
    return seconds


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = seconds / 60
    if minutes < 90:
        return f"{minutes:.1f} min"
    return f"{int(minutes // 60)} h {int(round(minutes % 60)):02d} min"
