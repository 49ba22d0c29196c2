"""Durations and sizes as people and Ollama clients write them."""

from __future__ import annotations

import math
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
# The longest keep-alive short of forever: longer is a mistake (and past a date's range).
MAX_DURATION_S = 366 * 24 * 3600.0
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def parse_duration(value: str | float | int) -> float:
    """Seconds from a keep-alive: a number of seconds, or Go-style text ("5m", "1h30m",
    "90s", "500ms"). A negative value means "forever" and is returned as -1; a finite one
    is at most `MAX_DURATION_S` (a year)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        return _seconds(value, value)
    text = value.strip().lower()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        return _seconds(seconds, value)
    negative = text.startswith("-")
    body = text.removeprefix("-")
    parts = _DURATION_PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise ValueError(f"{_shown(value)} is not a duration (e.g. 300, \"5m\", \"1h30m\", -1)")
    seconds = sum(float(n) * _DURATION_SECONDS[u] for n, u in parts)
    return -1.0 if negative and seconds > 0 else _seconds(seconds, value)


def _seconds(number: float | int, value: object) -> float:
    # Compared, not converted: float() of a huge int would overflow.
    if isinstance(number, float) and (math.isnan(number) or math.isinf(number)):
        raise ValueError(f"{_shown(value)} is not a duration (e.g. 300, \"5m\", -1 for forever)")
    if number > MAX_DURATION_S:
        raise ValueError(
            f"{_shown(value)} is longer than a year (at most {MAX_DURATION_S:.0f} s; -1: forever)"
        )
    return -1.0 if number < 0 else float(number)


def _shown(value: object) -> str:
    """The value for a message: repr() of an int over 4,300 digits raises."""
    if isinstance(value, int) and abs(value) > 10**30:
        return f"a {value.bit_length()}-bit number"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_size(value: str) -> int:
    """Bytes from "8GiB", "512M", "2g", "1048576"; 1024-based, as memory is counted."""
    m = _SIZE.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"{value!r} is not a size (e.g. 8GiB, 512MiB)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)
