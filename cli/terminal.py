"""What the command line prints: plain lines, flushed, free of control characters.

Text that came from a user or from stored data (org, play, run ids, keys, cell values, error
messages) can hold ANSI escape sequences, carriage returns or newlines that would repaint or
forge a terminal's output. Every line the CLI prints goes through `clean`: tabs and line breaks
become spaces, every other control character (C0, DEL, C1) is dropped. Lines are flushed as
they are printed, so a redirected log shows them even if the process is killed a moment later.

Scripting: with `--json` the command runs with `sys.stdout` redirected to stderr (see
`cli.main`), so its human lines go there, and stdout carries only the one JSON document
`emit_json` writes to the real stdout it is handed. A reader that closed stdout (`runplane status | head
-1`) ends nothing: the rest of stdout goes to /dev/null and the command finishes as it would have
(a run keeps running to its end, with no resume hint), quietly.

With `--log-format json` every line written to stderr becomes one JSON record
(`engine.observability.logs`), at level `warning` for `warn` and `info` otherwise.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from typing import Iterable, TextIO

from runplane.engine.observability import logs

_SPACING = re.compile(r"[\t\n\v\f\r]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean(text: object) -> str:
    """`text` as one printable line: line breaks and tabs become spaces, other controls go."""
    return _CONTROL.sub("", _SPACING.sub(" ", str(text)))


def say(line: object = "", *, file: TextIO | None = None, level: str = "info") -> None:
    """Print one cleaned line and flush it."""
    write(clean(line) + "\n", sys.stdout if file is None else file, level)


def write(text: str, stream: TextIO, level: str = "info") -> None:
    """Write and flush `text`; a closed pipe on stdout sends the rest of stdout to /dev/null.
    With JSON log lines, text for stderr is written as one record a line."""
    if stream is sys.stderr and logs.json_lines():
        text = "".join(logs.json_line(level, line, "runplane.cli") + "\n"
                       for line in text.splitlines() if line.strip())
    try:
        stream.write(text)
        stream.flush()
    except BrokenPipeError:
        if stream is sys.stdout or stream is sys.__stdout__:
            stdout_gone()


def stdout_gone() -> None:
    """The reader of stdout went away: point stdout at /dev/null (also for the flush at exit)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no file descriptor (a captured stream): nothing to redirect
        pass


def emit_json(document: object, stream: TextIO) -> None:
    """The command's one JSON document, on `stream` (the real stdout); a value JSON has no
    type for (a time) is written as its text."""
    write(json.dumps(document, ensure_ascii=False, default=str, indent=2) + "\n", stream)


def warn(line: object) -> None:
    say(line, file=sys.stderr, level="warning")


def shell_command(words: Iterable[str]) -> str:
    """A command line a user can paste into a POSIX shell."""
    return shlex.join(["runplane", *words])


def plural(count: int, noun: str) -> str:
    """`1 row`, `2 rows`."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def table_lines(header: tuple[str, ...], rows: list[tuple[object, ...]],
                right: tuple[int, ...] = ()) -> list[str]:
    """A plain text table: columns padded to their widest cleaned cell (at most 80 wide)."""
    cells = [[clean(c) for c in header]] + [[clean(c) for c in row] for row in rows]
    widths = [min(80, max(len(r[i]) for r in cells)) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = []
        for i, cell in enumerate(row):
            cell = cell if len(cell) <= 80 else cell[:79] + "…"
            parts.append(cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]))
        lines.append("  ".join(parts).rstrip())
    return lines
