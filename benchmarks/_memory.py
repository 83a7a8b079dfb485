"""A benchmark process's own peak memory: `VmHWM` from `/proc/self/status`.

Not `resource.getrusage(RUSAGE_SELF).ru_maxrss`: Linux keeps that across `exec`, so a child a
benchmark starts reports at least its parent's size at the time (a parent holding a
1,000,000-row list made a child's map read 396 MB above its input, against ~30 MB measured
alone). `VmHWM` belongs to the process's own address space, new at `exec`. Elsewhere than
Linux, `ru_maxrss` is all there is.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_mb() -> float:
    """The most this process has held resident so far, in MB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, else KiB
