"""Progress on stderr: a tqdm bar on a terminal, else one line per finished measurement
(with the measurements left and a time estimate)."""

from __future__ import annotations

import sys
import time
from typing import Any


def summary_line(record: dict) -> str:
    """What a finished measurement says in one line (the bar's companion on stderr)."""
    head = f"r{record['round']} {record['workload']:<9} {record['arm']:<19}"
    if "error" in record:
        return f"{head} FAILED {record['error'].splitlines()[0][:120]}"
    shown = []
    for key, value in record["metrics"].items():
        if value is not None and key.endswith(("tps", "ttft_p50", "ttft", "itl_p99")):
            shown.append(f"{key}={value:.3g}")
        if len(shown) == 4:
            break
    cpu = record.get("cpu") or {}
    flag = "  DISTURBED" if record.get("contaminated") else ""
    foreign = f" foreign CPU {cpu['foreign_share']:.0%}" if cpu else ""
    return f"{head} {' '.join(shown)}{foreign}{flag}"


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.monotonic()
        self._bar: Any = None
        # A bar only on a terminal: redrawn bars in a log file are noise; lines are not.
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.close()

    def begin(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(what)

    def update(self, record: dict) -> None:
        self.done += 1
        line = summary_line(record)
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
            self._bar.update(1)
            return
        elapsed = time.monotonic() - self.t0
        left = elapsed / self.done * (self.total - self.done)
        eta = f"~{left:.0f} s" if left < 90 else f"~{left / 60:.0f} min"
        print(f"[{self.done}/{self.total}, {eta} left] {line}", file=sys.stderr)
