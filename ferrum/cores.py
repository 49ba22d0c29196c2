"""How many CPU cores llama.cpp should use here."""

from __future__ import annotations

import os


def physical_cores() -> int:
    """Physical cores this process may use; llama.cpp runs slower on hyper-threads."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            cores = set()
            physical_id = core_id = ""
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "physical id":
                    physical_id = value
                elif key == "core id":
                    core_id = value
                    cores.add((physical_id, core_id))
        if cores:
            return min(len(cores), len(os.sched_getaffinity(0)))
    except OSError:
        pass
    return max(1, len(os.sched_getaffinity(0)))
