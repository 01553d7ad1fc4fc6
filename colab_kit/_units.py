"""Small parsers and formatters for sizes and durations (private helpers)."""

from __future__ import annotations

import re

_DURATION_UNITS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hrs": 3600, "hour": 3600, "hours": 3600,
}
_DURATION_PART = r"(\d+(?:\.\d+)?)\s*([a-z]+)"
_DURATION_RE = re.compile(rf"^\s*(?:{_DURATION_PART}\s*)+$")


def is_count(value) -> bool:
    """A whole number >= 1 (bool is an int in Python, but True is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_duration(text: str) -> float:
    """Parse "90s", "10min", "1.5h", or a sum of them such as "11h30m" or "1h 15min", into seconds.

    Raises:
        ValueError: with the accepted forms, for anything else.
    """
    text = str(text).lower()
    parts = re.findall(_DURATION_PART, text) if _DURATION_RE.match(text) else []
    if not parts or any(unit not in _DURATION_UNITS for _, unit in parts):
        raise ValueError(
            f"cannot read {text!r} as a duration; use a number with a unit such as "
            '"90s", "10min", "1h" or "11h30m", or an int for a number of optimizer steps'
        )
    seconds = sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
    if seconds <= 0:
        raise ValueError(f"the duration {text!r} must be longer than zero")
    return seconds


_RATE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*/\s*s\s*$")


def parse_rate(text) -> float:
    """Parse "1MB/s", "500 KB/s", "2MiB/s" (or a number of bytes per second) into bytes per second.

    Raises:
        ValueError: with the accepted forms, for anything else.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return float(text)
    match = _RATE_RE.match(str(text).lower())
    if not match or match.group(2) not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"cannot read {text!r} as an upload rate; use a size per second such as \"1MB/s\" or "
                         f"\"500KB/s\", or a number of bytes per second")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def format_bytes(n: float | None) -> str:
    """1536 -> "1.5 KiB"; None -> "n/a"."""
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_age(seconds: float) -> str:
    """Seconds -> "42 s", "7 min", "3.2 h", "2.0 days"."""
    seconds = max(0.0, float(seconds))
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
