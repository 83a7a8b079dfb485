"""Input preparation of outcomes: validate and encode them before any query.

How it works
- Outcome data goes through the shared fast path of `engine.canonical` (`is_canonical`, else
  `normalize_fast`) and the C encoder `patch_dumps` of `engine.sheets.inputs`.
- `prepare_outcomes` raises `InvalidInputError` naming the outcome and field for anything
  malformed, so the operations that call it refuse before any query; duplicates of a key
  collapse to the last one.
- A map worker builds its completed outcomes with `completed_outcome`, which normalizes and
  encodes the output once and keeps the outcome's `PreparedOutcome` on it (a slot no copy
  carries); `prepare_outcomes` takes that as it is (checking only the key's characters and the
  output names, which that function does not), and checks and encodes every other outcome.
  A gateway decoding a completion prepares its plain completed outcomes the same way without
  building them (`prepared_completed`) and hands `complete` the `PreparedOutcome`s, which
  `prepare_outcomes` takes as it takes a worker's.
- A failed outcome keeps the cause it was built with (bounded, cleaned like the message);
  one built without (or with an empty message) gets its message's (`causes.cause_of`).
This module does no I/O.
"""

from __future__ import annotations

from functools import partial
from itertools import repeat
from typing import Mapping, NamedTuple, Sequence

from .. import canonical
from ..canonical import is_canonical, is_clean_str, normalize_fast
from ..errors import InvalidInputError
from ..limits.bounds import ints_within
from ..limits.inputs import MAX_INPUT_INDEX

from .causes import MAX_CAUSE_BYTES, bound_cause, cause_of
from .field_names import field_problem, shown
from .inputs import ALWAYS_SAFE_KEY_CHARS, check_key, patch_dumps
from .model import (
    DEFAULT_ROW_ERROR, MAX_ATTEMPTS, MAX_SHEET_FIELDS, OUTCOME_STATUSES, OutcomeStatus, RowOutcome,
)


def _utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class PreparedOutcome(NamedTuple):
    key: str
    failed: bool
    input_index: int | None
    data_text: str
    meta_text: str | None
    error: str | None
    data_keys: tuple[str, ...]
    meta_keys: tuple[str, ...]
    size: int
    attempts: int
    cause: str | None = None  # a failed outcome's (`sheets.causes`), None for a completed one


def outcome_fields_problem(names: Sequence[str]) -> str | None:
    """Why an outcome with these output keys cannot be stored, or None (the row would
    fail alone, so the map checks this before completing; `complete` refuses it)."""
    if len(names) > MAX_SHEET_FIELDS:
        return f"{len(names)} output fields; a sheet holds at most {MAX_SHEET_FIELDS}"
    for name in names:
        problem = field_problem(name)
        if problem is not None:
            return f"{shown(name)} {problem}"
    return None


_COMPLETED = OutcomeStatus.COMPLETED.value
_new_object = object.__new__
_new_tuple = tuple.__new__  # a PreparedOutcome from all its fields, without its Python __new__
# The slots' own setters (member descriptors): a field set through one skips the lookup by
# name that `object.__setattr__` does on the frozen class for every field.
(_set_key, _set_status, _set_data, _set_index, _set_meta, _set_error, _set_attempts,
 _set_cause, _set_encoded) = (getattr(RowOutcome, name).__set__ for name in (
    "key", "status", "data", "input_index", "cell_meta", "error", "attempts", "cause",
    "_encoded"))


def completed_outcome(key: str, data: object, input_index: int | None, attempts: int,
                      path: str = "output") -> RowOutcome:
    """`RowOutcome(key, "completed", data=normalize_fast(data, path), input_index=...,
    attempts=...)`, prepared for completion once here (its data's patch text and output names,
    its size) and kept on the outcome, so `prepare_outcomes` neither checks nor encodes that
    data again (a map's worker builds its outcomes with it). The text is of the data as it was
    here: a caller changing the dict afterwards does not change what is written.

    Raises `InvalidInputError` naming `path` for data `normalize` refuses. A key, index or
    attempt count off the common case goes through the constructor, which checks it as it
    checks any outcome; the common case is checked here, without its validators.
    """
    data = normalize_fast(data, path)
    if _plain(key, data, input_index, attempts):
        outcome = _new_object(RowOutcome)
        _set_key(outcome, key)
        _set_status(outcome, _COMPLETED)
        _set_data(outcome, data)
        _set_index(outcome, input_index)
        _set_meta(outcome, None)
        _set_error(outcome, None)
        _set_attempts(outcome, attempts)
        _set_cause(outcome, None)
    else:
        outcome = RowOutcome(key, OutcomeStatus.COMPLETED, data=data, input_index=input_index,
                             attempts=attempts)
    _set_encoded(outcome, _prepared_completed(outcome.key, outcome.data, outcome.input_index,
                                              outcome.attempts))
    return outcome


def prepared_completed(key: object, data: object, input_index: object,
                       attempts: object) -> PreparedOutcome:
    """The `PreparedOutcome` of `completed_outcome(key, data, input_index, attempts)`, without
    the `RowOutcome` (a third of the work): for a caller that hands `complete` outcomes it
    prepared itself (a gateway decoding a completion: `prepare_outcomes` takes them as they
    are, checking their keys' characters and output names). Refuses what that function
    refuses, with its errors."""
    if is_canonical(data) and _plain(key, data, input_index, attempts):
        return _prepared_completed(key, data, input_index, attempts)  # type: ignore[arg-type]
    return completed_outcome(key, data, input_index, attempts)._encoded  # type: ignore[arg-type]


def prepared_completed_many(keys: list, datas: list, input_indexes: list,
                            attempts: list) -> list[PreparedOutcome]:
    """`prepared_completed` of each outcome given by its fields, one list a field: a list of
    plain outcomes is checked a column at a time (each check one pass in C, as `_plain`
    checks one), and anything off it goes one outcome at a time, with its errors."""
    if datas and set(map(type, datas)) == {dict} and all(map(is_canonical, datas)) \
            and set(map(type, keys)) == {str} \
            and 0 < min(map(len, keys)) and max(map(len, keys)) <= ALWAYS_SAFE_KEY_CHARS \
            and ints_within(input_indexes, 0, MAX_INPUT_INDEX) \
            and ints_within(attempts, 1, MAX_ATTEMPTS):
        texts = list(map(patch_dumps, datas))
        sizes = map(len, texts) if "".join(texts).isascii() else map(_utf8_size, texts)
        return list(map(_new_prepared, zip(
            keys, repeat(False), input_indexes, texts, repeat(None), repeat(None),
            map(tuple, datas), repeat(()), sizes, attempts, repeat(None))))
    return list(map(prepared_completed, keys, datas, input_indexes, attempts))


_new_prepared = partial(tuple.__new__, PreparedOutcome)  # from a tuple of all its fields


def _plain(key: object, data: object, input_index: object, attempts: object) -> bool:
    """A completed outcome's fields on the common case, which needs none of the constructor's
    validators: a dict of data, a key of a safe length, an index >= 0 or None, an attempt
    count in range (a key's characters are checked by `prepare_outcomes`)."""
    return type(data) is dict and type(key) is str and 0 < len(key) <= ALWAYS_SAFE_KEY_CHARS \
        and (input_index is None or type(input_index) is int
             and 0 <= input_index <= MAX_INPUT_INDEX) \
        and type(attempts) is int and 1 <= attempts <= MAX_ATTEMPTS


def _prepared_completed(key: str, data: dict, input_index: int | None,
                        attempts: int) -> PreparedOutcome:
    text = patch_dumps(data)
    return _new_tuple(PreparedOutcome, (  # the outcome's own fields
        key, False, input_index, text, None, None, tuple(data), (), _utf8_size(text), attempts,
        None))


def encoded_data(outcome: RowOutcome) -> tuple[str, tuple[str, ...]] | None:
    """The patch text and output names `completed_outcome` kept on `outcome`, or None."""
    prepared = getattr(outcome, "_encoded", None)
    return None if prepared is None else (prepared.data_text, prepared.data_keys)


def prepare_outcomes(outcomes: Sequence[object]) -> tuple[list[PreparedOutcome], int]:
    """Validate and encode outcomes; duplicates collapse to the last one.

    Returns the unique outcomes (each at the position of its last occurrence) and the number
    of input outcomes.
    """
    if isinstance(outcomes, (str, bytes, Mapping)) or not isinstance(outcomes, Sequence):
        raise InvalidInputError("outcomes must be a sequence of RowOutcome")
    by_key: dict[str, PreparedOutcome] = {}
    checked: set[tuple[str, ...]] = set()  # key sets already found valid (most outcomes share one)
    for i, outcome in enumerate(outcomes):
        if type(outcome) is PreparedOutcome:  # `prepared_completed` made it
            prepared = outcome
        else:
            prepared = getattr(outcome, "_encoded", None) if type(outcome) is RowOutcome else None
        if prepared is None:
            prepared = _prepare(i, outcome, checked)
        else:  # `completed_outcome` built it, and prepared it already
            if not is_clean_str(prepared.key):  # its type and length were checked there
                check_key(prepared.key, f"outcomes[{i}]")
            _check_output_names(i, prepared.data_keys, checked)
        key = prepared.key
        if key in by_key:
            del by_key[key]  # the last wins; it takes the position of its last occurrence
        by_key[key] = prepared
    return list(by_key.values()), len(outcomes)


def _check_output_names(i: int, names: tuple[str, ...], checked: set[tuple[str, ...]]) -> None:
    """Refuse outcome `i` when its output names cannot be stored (a set of names already
    found valid, in `checked`, costs one lookup)."""
    if names not in checked:
        problem = outcome_fields_problem(names)
        if problem is not None:
            raise InvalidInputError(f"outcomes[{i}].data: {problem}")
        checked.add(names)


def _prepare(i: int, outcome: object, checked: set[tuple[str, ...]]) -> PreparedOutcome:
    """Outcome `i` checked and encoded (one `completed_outcome` did not prepare)."""
    if type(outcome) is not RowOutcome and not isinstance(outcome, RowOutcome):
        raise InvalidInputError(
            f"outcomes[{i}] must be a RowOutcome, got {type(outcome).__name__}"
        )
    key = outcome.key
    if type(key) is not str or not 0 < len(key) <= ALWAYS_SAFE_KEY_CHARS \
            or not is_clean_str(key):
        check_key(key, f"outcomes[{i}]")
    status = outcome.status
    if status == OutcomeStatus.COMPLETED:
        failed = False
    elif status == OutcomeStatus.FAILED:
        failed = True
    else:
        raise InvalidInputError(
            f"outcomes[{i}].status {status!r} is not one of {OUTCOME_STATUSES}"
        )
    data = outcome.data
    if data is None:
        data = {}
    elif not is_canonical(data):
        data = normalize_fast(data, f"outcomes[{i}].data")
    data_keys = tuple(data)
    data_text = patch_dumps(data)
    _check_output_names(i, data_keys, checked)
    meta_text = None
    meta_keys: tuple[str, ...] = ()
    if outcome.cell_meta:
        meta = normalize_fast(outcome.cell_meta, f"outcomes[{i}].cell_meta")
        problem = outcome_fields_problem(tuple(meta))
        if problem is not None:
            raise InvalidInputError(f"outcomes[{i}].cell_meta: {problem}")
        for name, value in meta.items():
            if not name:
                raise InvalidInputError(f"outcomes[{i}].cell_meta: field name must not be empty")
            if type(value) is not dict:
                raise InvalidInputError(f"outcomes[{i}].cell_meta.{name} must be an object")
        meta_text = patch_dumps(meta)
        meta_keys = tuple(meta)
    error = cause = None
    if failed:
        error = outcome.error if outcome.error and outcome.error.strip() else DEFAULT_ROW_ERROR
        if not is_clean_str(error):
            error = canonical.normalize(error)
        cause = outcome.cause
        if cause is None or error == DEFAULT_ROW_ERROR:
            cause = cause_of(error)  # the message's own (no inputs known here)
        elif not is_clean_str(cause) or len(cause) * 4 > MAX_CAUSE_BYTES:
            cause = bound_cause(canonical.normalize(cause))
    size = _utf8_size(data_text)
    if meta_text is not None:
        size += _utf8_size(meta_text)
    return PreparedOutcome(key, failed, outcome.input_index, data_text, meta_text, error,
                           data_keys, meta_keys, size, outcome.attempts, cause)
