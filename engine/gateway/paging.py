"""Paging admission and completion under a gateway's body limit: pure logic, no I/O.

How it works
- A paged request is a fixed part (scope, contract, attempt, ...) and one or more arrays of
  per-row items. `measure_fixed` encodes the fixed part once; if it alone leaves no room for a
  row under `body_limit − PAGE_HEADROOM`, `InvalidInputError` is raised before anything is sent.
- `pack(sizes, room)` cuts the rows, in order, into pages whose items fit `room`; a row that
  cannot fit alone raises `InvalidInputError` naming its index in the caller's input.
- `page_body` assembles a page's JSON from texts the caller already encoded (each row is
  encoded once, by the validation that precedes paging), so sizes are exact and nothing is
  encoded twice.
- Paging never changes an outcome: the client validates, keys and deduplicates the whole call
  first (exactly as the engine would), so every page carries unique rows with their keys and
  their input indexes in the whole call, and every page is written at the run's write version.
- `check_admitted_page` holds each admission page's answer to that: it is at the call's write
  version, lists only rows the page sent (each once, at the index it was sent with) and counts
  no more new rows than it lists pending nor more cache hits than it sent; an answer that
  disagrees raises `ConflictError` before the next page is sent, never a silent merge.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Mapping, Sequence

from ..errors import ConflictError, InvalidInputError
from .protocol import PAGE_HEADROOM, dumps

if TYPE_CHECKING:
    from ..sheets.model import Admission, AdmittedRow, BlockedRow


def room_for_rows(fixed: dict, arrays: Sequence[str], body_limit: int, what: str) -> int:
    """Bytes left for row items once the fixed part and the empty arrays are counted."""
    empty = len(dumps({**fixed, **{name: [] for name in arrays}}))
    room = body_limit - PAGE_HEADROOM - empty
    if room < 1:
        raise InvalidInputError(
            f"{what}: the request's fixed part (scope, contract, attempt) takes {empty} bytes and "
            f"leaves no room for a row under the gateway's body limit of {body_limit} bytes"
        )
    return room


def pack(sizes: Sequence[int], positions: Sequence[int], room: int, what: str) -> list[tuple[int, int]]:
    """Consecutive `[start, end)` ranges of items whose sizes (each plus its separators) fit
    `room`; `positions[i]` is item i's index in the caller's input, for the error message."""
    pages: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, size in enumerate(sizes):
        if size > room:
            raise InvalidInputError(
                f"{what}[{positions[i]}] needs {size} bytes on the wire; one request to the "
                f"gateway holds at most {room} bytes of rows"
            )
        if used + size > room:
            pages.append((start, i))
            start, used = i, 0
        used += size
    if start < len(sizes) or not pages:
        pages.append((start, len(sizes)))
    return pages


def page_body(fixed: dict, arrays: Sequence[tuple[str, Sequence[str]]]) -> bytes:
    """The JSON of `fixed` plus arrays given as already encoded JSON texts."""
    head = dumps(fixed)
    parts = [head[:-1].decode("utf-8")]
    for name, texts in arrays:
        parts.append(f',"{name}":[' + ",".join(texts) + "]")
    parts.append("}")
    return "".join(parts).encode("utf-8")


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def disagree(what: str) -> ConflictError:
    """The error for an admission page's answer that disagrees with the page sent."""
    return ConflictError(f"the gateway answered an admission page that disagrees with the "
                         f"page sent: {what}")


def check_admitted_page(page: Admission, sent: Mapping[str, int], write_version: int) -> None:
    """Raise `ConflictError` unless admission page `page` (an `Admission`) answers for the rows
    `sent` (key -> input index) at `write_version` (see the module docstring)."""
    if page.write_version != write_version:
        raise disagree(f"admitted at write version {page.write_version}, not the run's "
                       f"{write_version}")
    rows = (*page.pending, *page.completed, *page.blocked)
    keys = list(map(_KEY, rows))
    if len(set(keys)) != len(keys) or list(map(sent.get, keys)) != list(map(_INDEX, rows)):
        _name_disagreeing_row(rows, sent)
    if page.inserted > len(page.pending):
        raise disagree(f"{page.inserted} rows inserted but {len(page.pending)} pending")
    if page.cached > len(sent):
        raise disagree(f"{page.cached} cache hits among {len(sent)} rows")


_KEY, _INDEX = attrgetter("key"), attrgetter("input_index")


def _name_disagreeing_row(rows: Sequence[AdmittedRow | BlockedRow],
                          sent: Mapping[str, int]) -> None:
    """Raise naming the first row of an answer that was not sent, or is listed twice."""
    listed: set[str] = set()
    for row in rows:
        if sent.get(row.key) != row.input_index:
            raise disagree(f"row {row.key!r} at input index {row.input_index} was not sent")
        if row.key in listed:
            raise disagree(f"row {row.key!r} is listed twice")
        listed.add(row.key)
