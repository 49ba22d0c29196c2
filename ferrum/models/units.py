"""Durations and sizes as people and Ollama clients write them."""

from __future__ import annotations

import math
import re

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(?:([kmgt])(?:i?b)?|b)?", re.IGNORECASE)


def parse_duration(value: str | float | int) -> float:
    """Seconds from a keep-alive: a number of seconds, or Go-style text ("5m", "1h30m",
    "90s", "500ms"). A negative value means "forever" and is returned as -1."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        return _seconds(float(value), value)
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
        raise ValueError(f"{value!r} is not a duration (e.g. 300, \"5m\", \"1h30m\", -1)")
    seconds = sum(float(n) * _DURATION_SECONDS[u] for n, u in parts)
    return -1.0 if negative and seconds > 0 else seconds


def _seconds(seconds: float, value: object) -> float:
    if math.isnan(seconds) or math.isinf(seconds):
        raise ValueError(f"{value!r} is not a duration (e.g. 300, \"5m\", -1 for forever)")
    return -1.0 if seconds < 0 else seconds


def parse_size(value: str) -> int:
    """Bytes from "8GiB", "512M", "2g", "1048576"; 1024-based, as memory is counted."""
    m = _SIZE.fullmatch(value.strip())
    if m is None:
        raise ValueError(f"{value!r} is not a size (e.g. 8GiB, 512MiB)")
    scale = 1024 ** " kmgt".index((m.group(2) or " ").lower())
    return int(float(m.group(1)) * scale)
