"""Input preparation of rows: validate, normalize, key and encode them before any query.

How it works
- Rows go through the shared fast path of `engine.canonical`: `is_canonical` proves a value
  already canonical without rebuilding it, and `normalize_fast` equals `canonical.normalize`
  (cleaning or refusing with the path named) on everything else. A canonical row is copied
  before it is kept, since it is the caller's own dict.
- `row_key(row, table_namespace)` is the SHA-256 (first 32 hex digits) of the normalized
  namespace, a newline, and the canonical JSON of the normalized row.
- `prepare_rows` raises `InvalidInputError` naming the row and field for anything malformed,
  so the operations that call it refuse before any query. Rows whose keys and texts a caller
  gave are checked a column at a time first (`_given_rows`), row by row only when that fails.
- `canonical_dumps` and `patch_dumps` are the reusable C encoders rows and outcomes share.
- Outcomes are prepared in `engine.sheets.outcome_inputs`.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Iterable, Mapping, NoReturn, Sequence

import attrs

from ..limits.bounds import ints_within, is_int
from .. import canonical
from ..canonical import JsonValue, is_canonical, is_clean_str, normalize_fast
from ..errors import InvalidInputError
from ..limits.inputs import MAX_INPUT_INDEX, MAX_KEY_BYTES, key_problem
from ..values.scopes import normalize_namespace


def key_of_text(namespace: str) -> Callable[[str], str]:
    """The row key of a canonical row text under `namespace` (normalized): the one place a row
    key is derived (see the module docstring); every other keying goes through it."""
    prefix = f"{namespace}\n".encode()
    sha256 = hashlib.sha256
    return lambda text: sha256(prefix + text.encode()).hexdigest()[:32]


def text_keys(table_namespace: str, texts: Iterable[str]) -> list[str]:
    """`row_key` of each row given as its canonical text (`canonical.stable_dumps` of the
    normalized row), for callers that already encoded them."""
    return list(map(key_of_text(normalize_namespace(table_namespace)), texts))


def text_key(table_namespace: str, row_text: str) -> str:
    """`row_key` of one row given as its canonical text."""
    return text_keys(table_namespace, (row_text,))[0]


def row_key(row: Mapping[str, object], table_namespace: str) -> str:
    """The stable identity of a row in a sheet: hash of normalized namespace and row."""
    if not isinstance(row, Mapping):
        raise InvalidInputError(f"row must be a dict, got {type(row).__name__}")
    namespace = normalize_namespace(table_namespace)
    return key_of_text(namespace)(canonical.stable_dumps(canonical.normalize(row, "row")))


@attrs.frozen
class PreparedRows:
    """Admission input after validation and deduplication (first occurrence wins)."""

    keys: list[str]
    indexes: list[int]
    rows: list[dict]
    texts: list[str] | None  # canonical JSON of each row, when input cells are stored
    skipped: int


# A key this short is within both key limits whatever its characters (4 UTF-8 bytes at most
# each), so the hot path checks only its length.
ALWAYS_SAFE_KEY_CHARS = MAX_KEY_BYTES // 4


def check_key(key: object, where: str) -> str:
    if not isinstance(key, str):
        raise InvalidInputError(f"{where}: key must be a string, got {type(key).__name__}")
    problem = key_problem(key)
    if problem is not None:
        raise InvalidInputError(f"{where}: key {problem}")
    if not is_clean_str(key):
        raise InvalidInputError(f"{where}: key holds NUL or a lone surrogate")
    return key


def check_input_indexes(input_indexes: object, count: int) -> None:
    """Explicit input indexes: a sequence of `count` integers >= 0."""
    if isinstance(input_indexes, (str, bytes)) or not isinstance(input_indexes, Sequence) \
            or len(input_indexes) != count:
        raise InvalidInputError("input_indexes must be a sequence as long as rows")
    if not count or ints_within(input_indexes, 0, MAX_INPUT_INDEX):
        return  # the loop names an index that fails
    for position, index in enumerate(input_indexes):
        if not is_int(index, 0, MAX_INPUT_INDEX):
            raise InvalidInputError(
                f"input_indexes[{position}] must be an integer from 0 to {MAX_INPUT_INDEX}")


def prepare_rows(
    rows: Sequence[object],
    namespace: str,
    *,
    input_offset: int,
    keys: Sequence[object] | None,
    need_texts: bool,
    input_indexes: Sequence[object] | None = None,
    keep_rows: bool = True,
    texts: Sequence[object] | None = None,
) -> PreparedRows:
    """Validate, normalize, key and deduplicate admission rows; raise before any query.

    A row's input index is `input_offset` + its position, or `input_indexes[position]` when
    those are given (a gateway client sends a deduplicated page of a larger call). With
    `keep_rows=False` (a probe: keys alone) `rows` of the result is empty and no row is copied.
    `texts` (only with `keys`) are the rows' canonical texts from a caller that encoded them
    already (`engine.array_input.encode_source`): the rows are then taken as they are —
    normalized, and the caller's own — and not encoded again.
    """
    _check_arguments(rows, input_offset, keys, texts)
    if texts is not None:  # and keys: a caller that keyed and encoded its rows
        given = _given_rows(rows, keys, texts, input_offset, input_indexes, need_texts,
                            keep_rows)
        if given is not None:
            return given
    if input_indexes is not None:
        check_input_indexes(input_indexes, len(rows))
    elif keys is None and not need_texts and not keep_rows:
        fast = _probe_keys(rows, namespace)
        if fast is not None:
            return PreparedRows(fast, list(range(input_offset, input_offset + len(fast))), [],
                                None, 0)
    return _key_rows(rows, namespace, input_offset, keys, need_texts, input_indexes,
                     keep_rows, texts)


def _check_arguments(rows: Sequence[object], input_offset: int, keys: Sequence[object] | None,
                     texts: Sequence[object] | None) -> None:
    """The call's shape, before any row is read: an offset >= 0, a sequence of rows (none
    given an index past `MAX_INPUT_INDEX` by the offset), and keys and texts (texts only with
    keys) as long as the rows."""
    if not is_int(input_offset, 0):
        raise InvalidInputError(f"input_offset must be an integer >= 0, got {input_offset!r}")
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise InvalidInputError("rows must be a sequence of dicts")
    if input_offset + len(rows) - 1 > MAX_INPUT_INDEX:
        raise InvalidInputError(f"input_offset {input_offset} gives rows input indexes past "
                                f"{MAX_INPUT_INDEX}")
    if keys is not None:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidInputError("keys must be a sequence of strings")
        if len(keys) != len(rows):
            raise InvalidInputError(
                f"keys has {len(keys)} entries but rows has {len(rows)}; they must match"
            )
    if texts is not None:
        if keys is None:
            raise InvalidInputError("texts can only be given with keys")
        if isinstance(texts, (str, bytes)) or not isinstance(texts, Sequence) \
                or len(texts) != len(rows):
            raise InvalidInputError("texts must be a sequence as long as rows")


def _key_rows(rows: Sequence[object], namespace: str, input_offset: int,
              keys: Sequence[object] | None, need_texts: bool,
              input_indexes: Sequence[object] | None, keep_rows: bool,
              texts: Sequence[object] | None) -> PreparedRows:
    """The general path, one loop over the rows: each checked to be a dict, normalized unless
    canonical (or taken as it is with the caller's text), keyed (or its given key checked),
    and kept only the first time its key is seen."""
    dumps = canonical_dumps
    key_of = key_of_text(namespace)
    seen: set[str] = set()
    out_keys: list[str] = []
    out_indexes: list[int] = []
    out_rows: list[dict] = []
    given = texts
    out_texts: list[str] | None = [] if (need_texts or keys is None) else None
    for position, row in enumerate(rows):
        if type(row) is not dict and not isinstance(row, dict):
            raise InvalidInputError(f"rows[{position}] must be a dict, got {type(row).__name__}")
        if given is not None:
            clean, text = row, given[position]
            if type(text) is not str:
                raise InvalidInputError(f"texts[{position}] must be a string")
        else:
            if is_canonical(row):
                clean = dict(row) if keep_rows else row
            else:
                clean = normalize_fast(row, f"rows[{position}]")
            text = dumps(clean) if out_texts is not None else None
        if keys is None:
            key = key_of(text)
        else:
            key = keys[position]
            if type(key) is not str or not 0 < len(key) <= ALWAYS_SAFE_KEY_CHARS \
                    or not is_clean_str(key):
                check_key(key, f"keys[{position}]")
        if key in seen:
            continue
        seen.add(key)
        out_keys.append(key)
        out_indexes.append(
            input_offset + position if input_indexes is None else input_indexes[position])
        if keep_rows:
            out_rows.append(clean)
        if out_texts is not None:
            out_texts.append(text)
    return PreparedRows(
        out_keys, out_indexes, out_rows, out_texts if need_texts else None,
        len(rows) - len(out_keys),
    )


def _given_rows(rows: Sequence[object], keys: Sequence[object], texts: Sequence[object],
                input_offset: int, input_indexes: Sequence[object] | None, need_texts: bool,
                keep_rows: bool) -> PreparedRows | None:
    """Rows whose keys and texts the caller gave, checked a column at a time (each check one
    pass in C): every row a dict, every text a string, every key a distinct ASCII string of
    a safe length without NUL, every input index (when given) an integer >= 0. The rows are
    taken as they are, as the row-by-row loop takes them with texts; None when any check
    fails, and that loop then refuses the row naming it (or, for duplicate keys, drops the
    later ones)."""
    count = len(rows)
    if not count or set(map(type, rows)) != {dict} or set(map(type, texts)) != {str} \
            or set(map(type, keys)) != {str} or len(set(keys)) != count:
        return None
    lengths = list(map(len, keys))
    joined = "".join(keys)
    if min(lengths) == 0 or max(lengths) > ALWAYS_SAFE_KEY_CHARS or not joined.isascii() \
            or "\x00" in joined:
        return None
    if input_indexes is None:
        indexes = list(range(input_offset, input_offset + count))
    elif type(input_indexes) is range:
        if len(input_indexes) != count or input_indexes[0] < 0 or input_indexes.step < 0 \
                or input_indexes[-1] > MAX_INPUT_INDEX:
            return None
        indexes = list(input_indexes)
    else:
        if isinstance(input_indexes, (str, bytes)) or not isinstance(input_indexes, Sequence) \
                or len(input_indexes) != count \
                or not ints_within(input_indexes, 0, MAX_INPUT_INDEX):
            return None
        indexes = list(input_indexes)
    return PreparedRows(list(keys), indexes, list(rows) if keep_rows else [],
                        list(texts) if need_texts else None, 0)


def _probe_keys(rows: Sequence[object], namespace: str) -> list[str] | None:
    """The keys of `rows` when every row is a canonical dict and no two are alike, else None
    (then the general loop of `prepare_rows` keys them, or refuses one naming it). A probe's
    hot path: no copies, and `map` instead of a Python loop per step."""
    if not all([type(row) is dict for row in rows]) or not all(map(is_canonical, rows)):
        return None
    keys = list(map(key_of_text(namespace), map(canonical_dumps, rows)))
    return keys if len(set(keys)) == len(keys) else None


def _refuse(value: object) -> NoReturn:
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _c_encoder(sort_keys: bool) -> Callable[[JsonValue], str]:
    """A reusable C JSON encoder (json.dumps builds a new one per call) with the canonical
    settings: compact, UTF-8 text, no NaN. Only for values already canonical."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has it
        return json.JSONEncoder(
            ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys, allow_nan=False,
            check_circular=False,
        ).encode
    encode = make(None, _refuse, json.encoder.encode_basestring, None, ":", ",", sort_keys,
                  False, False)
    join = "".join
    return lambda value: join(encode(value, 0))


canonical_dumps = _c_encoder(sort_keys=True)  # == canonical.stable_dumps on canonical values
patch_dumps = _c_encoder(sort_keys=False)
