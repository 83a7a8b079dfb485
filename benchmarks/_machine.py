"""How busy the whole machine has been: its CPU seconds so far, from `/proc/stat`.

A benchmark reads it before and after a phase: the difference, less its own processes' CPU,
is what the rest of the machine (the PostgreSQL server, mostly) spent; divided by the phase's
seconds, how many cores were busy on average. None where there is no `/proc/stat`.
"""

from __future__ import annotations

import os


def machine_busy_s() -> float | None:
    """CPU seconds every core of the machine has spent busy so far (idle and iowait left
    out), or None without `/proc/stat`."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
