"""Where benchmarks run: `RUNPLANE_BENCH_DSN`, else `RUNPLANE_TEST_DSN`, else a throwaway
embedded server (deleted at exit)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def bench_dsn() -> str:
    for name in ("RUNPLANE_BENCH_DSN", "RUNPLANE_TEST_DSN"):
        if os.environ.get(name):
            return os.environ[name]
    from runplane.engine.embedded import start_embedded

    return start_embedded(Path(tempfile.mkdtemp(prefix="runplane-bench-")) / "pg", temporary=True)
