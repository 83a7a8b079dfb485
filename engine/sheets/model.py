"""Sheet values: contracts, attempts, policies, outcomes and results, and their validation.

How it works
- Everything here is a frozen attrs value whose validators raise `InvalidInputError` naming the
  field, so an invalid contract, attempt, policy or outcome cannot be built. Validation that
  needs a position (`rows[3]`, `outcomes[7].data.score`) happens in `prepare_rows` /
  `prepare_outcomes`, before any query.
- Field names are cleaned the way jsonb cleans object keys (NUL and lone surrogates become
  U+FFFD), so a contract field and the matching row key always name the same cell. Any other
  non-empty string is a valid field name, including ones that start with `_` or exceed 63 bytes
  (physical names are derived in `engine.sheets.layout`).
- `row_key(row, table_namespace)` is the SHA-256 (first 32 hex digits) of the normalized
  namespace, a newline, and the canonical JSON of the normalized row.
This module does no I/O.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

import attrs

from engine import canonical
from engine.errors import InvalidInputError
from engine.scopes import normalize_namespace

MAX_KEY_CHARS = 1024
OUTCOME_STATUSES = ("completed", "failed")
ROW_STATUSES = ("pending", "running", "enriched", "failed", "stale")
FENCE_REASONS = (
    "stale_write_version", "unadmitted", "attempt_superseded", "already_completed", "missing",
)
BLOCK_REASONS = ("newer_run", "attempt_active")
DEFAULT_ROW_ERROR = "Row execution failed."


def clean_field(name: object, where: str) -> str:
    """A field name as jsonb stores it as an object key; refuses non-strings and ''."""
    if not isinstance(name, str):
        raise InvalidInputError(f"{where}: field name {name!r} is not a string")
    if not name:
        raise InvalidInputError(f"{where}: field name must not be empty")
    return canonical.normalize(name, where)


def _fields(where: str):
    def convert(value: object) -> tuple[str, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise InvalidInputError(f"SheetContract.{where} must be a sequence of field names")
        out: dict[str, None] = {}
        for i, name in enumerate(value):
            out[clean_field(name, f"SheetContract.{where}[{i}]")] = None
        return tuple(out)

    return convert


@attrs.frozen
class SheetContract:
    """The fields of a sheet: `inputs` are stored at admission, `outputs` at completion.

    Repeated names collapse to their first occurrence; a name in both lists is refused.
    """

    inputs: tuple[str, ...] = attrs.field(converter=_fields("inputs"), default=())
    outputs: tuple[str, ...] = attrs.field(converter=_fields("outputs"), default=())

    def __attrs_post_init__(self) -> None:
        both = set(self.inputs) & set(self.outputs)
        if both:
            raise InvalidInputError(
                f"SheetContract: field {sorted(both)[0]!r} is listed both as input and as output"
            )

    @property
    def fields(self) -> tuple[str, ...]:
        return self.inputs + self.outputs


def _non_negative_number(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidInputError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise InvalidInputError(f"{name} must be a finite number >= 0, got {value!r}")

    return check


def _non_empty_str(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if not isinstance(value, str) or not value:
            raise InvalidInputError(f"{name} must be a non-empty string, got {value!r}")
        if canonical.normalize(value) != value:
            raise InvalidInputError(f"{name} holds NUL or a lone surrogate")

    return check


def _non_negative_int(name: str):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInputError(f"{name} must be an integer >= 0, got {value!r}")

    return check


@attrs.frozen
class Attempt:
    """One scheduler attempt of a run. Admitted rows are leased to it for `lease_s` seconds.

    Fences compare `attempt_id`s; `seq` is recorded with the lease for diagnosis. A lease of 0 s
    is admitted already expired (another attempt may take the row over at once).
    """

    attempt_id: str = attrs.field(validator=_non_empty_str("Attempt.attempt_id"))
    seq: int = attrs.field(validator=_non_negative_int("Attempt.seq"))
    lease_s: float = attrs.field(default=300.0, validator=_non_negative_number("Attempt.lease_s"))


@attrs.frozen
class CellPolicy:
    """A completed cell older than `stale_after_s` seconds is stale: its row is re-admitted."""

    stale_after_s: float = attrs.field(validator=_non_negative_number("CellPolicy.stale_after_s"))


@attrs.frozen
class Timing:
    """One measured phase of an admission."""

    phase: str
    ms: float
    rows: int = 0


@attrs.frozen
class AdmittedRow:
    key: str
    input_index: int
    row: dict


@attrs.frozen
class BlockedRow:
    key: str
    input_index: int
    reason: Literal["newer_run", "attempt_active"]


@attrs.frozen
class Admission:
    """What `admit` did. `pending`, `completed` and `blocked` keep the input order.

    `inserted` counts new rows (also listed in `pending`); `skipped` counts duplicates of an
    earlier row of the same call.
    """

    inserted: int
    skipped: int
    pending: tuple[AdmittedRow, ...]
    completed: tuple[AdmittedRow, ...]
    blocked: tuple[BlockedRow, ...]
    write_version: int
    timings: tuple[Timing, ...] = ()


def _outcome_key(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidInputError(f"RowOutcome.key must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= MAX_KEY_CHARS:
        raise InvalidInputError(f"RowOutcome.key must have 1 to {MAX_KEY_CHARS} characters")


def _outcome_status(instance: Any, _attribute: object, value: object) -> None:
    if value not in OUTCOME_STATUSES:
        raise InvalidInputError(
            f"RowOutcome {instance.key!r}: status {value!r} is not one of {OUTCOME_STATUSES}"
        )


def _outcome_optional(kind: type, name: str):
    def check(instance: Any, _attribute: object, value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(
                f"RowOutcome {instance.key!r}: {name} must be a {kind.__name__} or None, "
                f"got {type(value).__name__}"
            )

    return check


def _outcome_index(instance: Any, _attribute: object, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidInputError(
            f"RowOutcome {instance.key!r}: input_index must be an integer >= 0 or None"
        )


@attrs.frozen
class RowOutcome:
    """The result of running the map function on one admitted row.

    `data` patches the row's cells (only the keys present); `cell_meta` maps field names to
    objects merged into the row's cell meta; `error` is the failed row's message.
    """

    key: str = attrs.field(validator=_outcome_key)
    status: str = attrs.field(validator=_outcome_status)
    data: dict | None = attrs.field(default=None, validator=_outcome_optional(dict, "data"))
    input_index: int | None = attrs.field(default=None, validator=_outcome_index)
    cell_meta: dict | None = attrs.field(
        default=None, validator=_outcome_optional(dict, "cell_meta")
    )
    error: str | None = attrs.field(default=None, validator=_outcome_optional(str, "error"))


@attrs.frozen
class FencedRow:
    key: str
    reason: str
    row_write_version: int | None


@attrs.frozen
class CompletionDiagnostics:
    """Payload-free telemetry of one `complete` call (elapsed ms, failures, row counts).

    Phases: permit wait and connect (the checkout; split by the port's permit telemetry when it
    has one), BEGIN, the exact-key updates of completed rows, the repair and insertion of rows
    missing by key, the updates of failed rows, COMMIT, and the whole call.
    """

    outcome: Literal["succeeded", "failed"]
    input_rows: int
    unique_rows: int
    completed_rows: int
    failed_rows: int
    chunks: int
    updated_rows: int
    fenced_rows: int
    column_retries: int
    permit_wait_ms: float
    permit_wait_failures: int
    connect_ms: float
    connect_failures: int
    begin_ms: float
    begin_failures: int
    update_ms: float
    update_failures: int
    insert_missing_ms: float
    insert_missing_failures: int
    failed_update_ms: float
    failed_update_failures: int
    commit_ms: float
    commit_failures: int
    total_ms: float


@attrs.frozen
class Completion:
    """What `complete` did. `updated` counts rows physically changed (inserted ones too);
    `committed_keys` lists every outcome that holds after the call (applied, or an identical
    replay), in first-seen order; `fenced` lists the others with their reasons."""

    updated: int
    committed_keys: tuple[str, ...]
    fenced: tuple[FencedRow, ...]
    diagnostics: CompletionDiagnostics | None = None


@attrs.frozen
class ColumnSummary:
    completed: int
    failed: int


@attrs.frozen
class Summary:
    """Counters of a sheet: all rows, pending (`queued`), running, enriched (`completed`) and
    failed rows; per field, cells whose cell meta status is completed / failed."""

    total: int
    queued: int
    running: int
    completed: int
    failed: int
    columns: Mapping[str, ColumnSummary] = attrs.field(factory=dict)


# -- keys and input preparation -------------------------------------------------------------
_INT_LIMIT = 10**canonical.MAX_INT_DIGITS
_isfinite = math.isfinite


def _is_clean_str(value: str) -> bool:
    if value.isascii():
        return "\x00" not in value
    return canonical._UNSTORABLE.search(value) is None


def is_canonical(value: Any, depth: int = 0) -> bool:
    """True when `canonical.normalize(value)` would return an equal value of the same types.

    A fast check without allocation or path strings (scalars inside containers are checked
    inline, the common case of flat rows); anything it is unsure of is False, and callers then
    take `canonical.normalize`, which cleans or refuses with the path named.
    """
    kind = type(value)
    if kind is dict:
        if depth >= canonical.MAX_DEPTH:
            return False
        for key, item in value.items():
            if type(key) is not str or not (
                ("\x00" not in key) if key.isascii() else _is_clean_str(key)
            ):
                return False
            kind = type(item)
            if kind is str:
                if not (("\x00" not in item) if item.isascii() else _is_clean_str(item)):
                    return False
            elif kind is int:
                if not -_INT_LIMIT < item < _INT_LIMIT:
                    return False
            elif kind is float:
                if not _isfinite(item) or item.is_integer():
                    return False
            elif item is None or item is True or item is False:
                continue
            elif not is_canonical(item, depth + 1):
                return False
        return True
    if kind is list:
        if depth >= canonical.MAX_DEPTH:
            return False
        for item in value:
            kind = type(item)
            if kind is str:
                if not (("\x00" not in item) if item.isascii() else _is_clean_str(item)):
                    return False
            elif kind is int:
                if not -_INT_LIMIT < item < _INT_LIMIT:
                    return False
            elif item is None or item is True or item is False:
                continue
            elif not is_canonical(item, depth + 1):
                return False
        return True
    if kind is str:
        return _is_clean_str(value)
    if value is None or value is True or value is False:
        return True
    if kind is int:
        return -_INT_LIMIT < value < _INT_LIMIT
    if kind is float:
        return _isfinite(value) and not value.is_integer()
    return False


class _NotSimple(Exception):
    """Raised by `_rebuild` when a value needs `canonical.normalize` (to clean or refuse it)."""


def _rebuild(value: Any, depth: int) -> Any:
    """Rebuild a value whose only departure from canonical form is integral floats."""
    kind = type(value)
    if kind is float:
        if not _isfinite(value):
            raise _NotSimple
        return int(value) if value.is_integer() else value
    if kind is dict:
        if depth >= canonical.MAX_DEPTH:
            raise _NotSimple
        out = {}
        for key, item in value.items():
            if type(key) is not str or not _is_clean_str(key):
                raise _NotSimple
            out[key] = _rebuild(item, depth + 1)
        return out
    if kind is list:
        if depth >= canonical.MAX_DEPTH:
            raise _NotSimple
        return [_rebuild(item, depth + 1) for item in value]
    if is_canonical(value, depth):
        return value
    raise _NotSimple


def normalize_fast(value: Any, path: str) -> Any:
    """`canonical.normalize(value, path)`, without its per-element path strings on the common
    inputs: canonical values are returned as they are, values whose only departure is an
    integral float are rebuilt directly, anything else goes through `canonical.normalize`."""
    if is_canonical(value):
        return value
    try:
        return _rebuild(value, 0)
    except _NotSimple:
        return canonical.normalize(value, path)


def _key_of(namespace: str, row_text: str) -> str:
    return hashlib.sha256(f"{namespace}\n{row_text}".encode("utf-8")).hexdigest()[:32]


def row_key(row: Mapping[str, Any], table_namespace: str) -> str:
    """The stable identity of a row in a sheet: hash of normalized namespace and row."""
    if not isinstance(row, Mapping):
        raise InvalidInputError(f"row must be a dict, got {type(row).__name__}")
    namespace = normalize_namespace(table_namespace)
    return _key_of(namespace, canonical.stable_dumps(canonical.normalize(row, "row")))


@attrs.frozen
class PreparedRows:
    """Admission input after validation and deduplication (first occurrence wins)."""

    keys: list[str]
    indexes: list[int]
    rows: list[dict]
    texts: list[str] | None  # canonical JSON of each row, when input cells are stored
    skipped: int


def check_key(key: object, where: str) -> str:
    if not isinstance(key, str):
        raise InvalidInputError(f"{where}: key must be a string, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_CHARS:
        raise InvalidInputError(f"{where}: key must have 1 to {MAX_KEY_CHARS} characters")
    if not _is_clean_str(key):
        raise InvalidInputError(f"{where}: key holds NUL or a lone surrogate")
    return key


def prepare_rows(
    rows: Sequence[Any],
    namespace: str,
    *,
    input_offset: int,
    keys: Sequence[Any] | None,
    need_texts: bool,
) -> PreparedRows:
    """Validate, normalize, key and deduplicate admission rows; raise before any query."""
    if isinstance(input_offset, bool) or not isinstance(input_offset, int) or input_offset < 0:
        raise InvalidInputError(f"input_offset must be an integer >= 0, got {input_offset!r}")
    if isinstance(rows, (str, bytes, Mapping)) or not isinstance(rows, Sequence):
        raise InvalidInputError("rows must be a sequence of dicts")
    if keys is not None:
        if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
            raise InvalidInputError("keys must be a sequence of strings")
        if len(keys) != len(rows):
            raise InvalidInputError(
                f"keys has {len(keys)} entries but rows has {len(rows)}; they must match"
            )
    dumps = canonical_dumps
    seen: set[str] = set()
    out_keys: list[str] = []
    out_indexes: list[int] = []
    out_rows: list[dict] = []
    texts: list[str] | None = [] if (need_texts or keys is None) else None
    for position, row in enumerate(rows):
        if type(row) is not dict and not isinstance(row, dict):
            raise InvalidInputError(f"rows[{position}] must be a dict, got {type(row).__name__}")
        clean = dict(row) if is_canonical(row) else normalize_fast(row, f"rows[{position}]")
        text = dumps(clean) if texts is not None else None
        if keys is None:
            key = _key_of(namespace, text)
        else:
            key = check_key(keys[position], f"keys[{position}]")
        if key in seen:
            continue
        seen.add(key)
        out_keys.append(key)
        out_indexes.append(input_offset + position)
        out_rows.append(clean)
        if texts is not None:
            texts.append(text)
    return PreparedRows(
        out_keys, out_indexes, out_rows, texts if need_texts else None, len(rows) - len(out_keys)
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


def _refuse(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _c_encoder(sort_keys: bool) -> Callable[[Any], str]:
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


def prepare_outcomes(outcomes: Sequence[Any]) -> tuple[list[PreparedOutcome], int]:
    """Validate and encode outcomes; duplicates collapse to the last one.

    Returns the unique outcomes (each at the position of its last occurrence) and the number
    of input outcomes.
    """
    if isinstance(outcomes, (str, bytes, Mapping)) or not isinstance(outcomes, Sequence):
        raise InvalidInputError("outcomes must be a sequence of RowOutcome")
    by_key: dict[str, PreparedOutcome] = {}
    dumps = patch_dumps
    for i, outcome in enumerate(outcomes):
        if type(outcome) is not RowOutcome and not isinstance(outcome, RowOutcome):
            raise InvalidInputError(
                f"outcomes[{i}] must be a RowOutcome, got {type(outcome).__name__}"
            )
        key = outcome.key
        if type(key) is not str or not 0 < len(key) <= MAX_KEY_CHARS or not _is_clean_str(key):
            check_key(key, f"outcomes[{i}]")
        status = outcome.status
        if status == "completed":
            failed = False
        elif status == "failed":
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
        if "" in data:
            raise InvalidInputError(f"outcomes[{i}].data: field name must not be empty")
        meta_text = None
        meta_keys: tuple[str, ...] = ()
        if outcome.cell_meta:
            meta = normalize_fast(outcome.cell_meta, f"outcomes[{i}].cell_meta")
            for name, value in meta.items():
                if not name:
                    raise InvalidInputError(f"outcomes[{i}].cell_meta: field name must not be empty")
                if type(value) is not dict:
                    raise InvalidInputError(f"outcomes[{i}].cell_meta.{name} must be an object")
            meta_text = dumps(meta)
            meta_keys = tuple(meta)
        error = None
        if failed:
            error = outcome.error if outcome.error and outcome.error.strip() else DEFAULT_ROW_ERROR
            if not _is_clean_str(error):
                error = canonical.normalize(error)
        data_text = dumps(data)
        size = len(data_text) if data_text.isascii() else len(data_text.encode("utf-8"))
        if meta_text is not None:
            size += _utf8_size(meta_text)
        if key in by_key:
            del by_key[key]  # the last wins; it takes the position of its last occurrence
        by_key[key] = PreparedOutcome(
            key, failed, outcome.input_index, data_text, meta_text, error, tuple(data),
            meta_keys, size,
        )
    return list(by_key.values()), len(outcomes)
