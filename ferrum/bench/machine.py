"""Machine load: is anyone else using the CPUs while a server is being measured?

llama.cpp's compute threads spin-wait at barriers, so another busy process on the same cores
slows a server by far more than its CPU share; such measurements must be recognisable. Before
each server start the harness waits (a bounded time) for an idle machine, and during each
measurement it counts the CPU time spent by processes other than the server's process group
and this client ("foreign" CPU). Linux only (/proc); elsewhere the checks report nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from the first line of /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def group_jiffies(pgid: int) -> int:
    """utime + stime of the live processes (all threads) in process group `pgid`."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(fields[2]) == pgid:  # fields from "state" on: state ppid pgrp ... utime stime
            total += int(fields[11]) + int(fields[12])
    return total


def snapshot(pgid: int | None) -> dict | None:
    if not Path("/proc/stat").exists():
        return None
    busy, total = cpu_jiffies()
    me = os.times()
    return {
        "busy": busy,
        "total": total,
        "server": group_jiffies(pgid) if pgid else 0,
        # children: the engine workload's subprocesses, once they have been waited for
        "client_s": me.user + me.system + me.children_user + me.children_system,
        "t": time.monotonic(),
    }


def usage(a: dict | None, b: dict | None) -> dict | None:
    """CPU seconds of the server, this client and everyone else between two snapshots."""
    if a is None or b is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy_s, server_s = (b["busy"] - a["busy"]) / tick, (b["server"] - a["server"]) / tick
    client_s, wall = b["client_s"] - a["client_s"], max(1e-9, b["t"] - a["t"])
    foreign = max(0.0, busy_s - server_s - client_s)
    return {
        "wall_s": wall,
        "server_cpu_s": server_s,
        "client_cpu_s": client_s,
        "foreign_cpu_s": foreign,
        "foreign_share": foreign / (wall * (os.cpu_count() or 1)),
    }


def busy_share(interval: float = 1.0) -> float:
    b0, t0 = cpu_jiffies()
    time.sleep(interval)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / max(1, t1 - t0)


def wait_quiet(threshold: float, limit_s: float) -> dict:
    """Wait (at most `limit_s`) until the machine's busy share over 1 s is <= threshold."""
    if not Path("/proc/stat").exists():
        return {"busy_share": None, "waited_s": 0.0, "quiet": True}
    start = time.monotonic()
    while True:
        share, waited = busy_share(), time.monotonic() - start
        if share <= threshold or waited >= limit_s:
            return {"busy_share": share, "waited_s": waited, "quiet": share <= threshold}
