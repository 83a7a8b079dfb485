"""Sheet values: contracts, attempts, policies, outcomes and results, and their validation.

How it works
- Everything here is a frozen attrs value whose validators raise `InvalidInputError` naming the
  field, so an invalid contract, attempt, policy or outcome cannot be built. Validation that
  needs a position (`rows[3]`, `outcomes[7].data.score`) happens in `prepare_rows` /
  `prepare_outcomes`, before any query.
- Field names: 1 to `MAX_FIELD_CHARS` characters, not starting with `_` (the
  system columns' prefix: `read_rows` returns `_key`, `_status`… beside the fields), and, in a
  contract, no NUL; a lone surrogate is cleaned to U+FFFD the way jsonb cleans object keys, so a
  contract field and the matching row key always name the same cell. Output keys in completion
  data follow the same rules (their NUL is cleaned like any JSON text). Physical names are
  allocated in `engine.sheets.layout`.
- A sheet holds at most `MAX_SHEET_FIELDS` fields (contract and added ones together): a row
  with every field set must fit one 8 KiB heap page once PostgreSQL has moved its large values
  out of line (an 18-byte pointer each), and completion writes two target entries per field
  (PostgreSQL allows 1,664 a statement). A contract past it is refused here, before any query;
  a completion that would add fields past it is refused row by row.
- Row keys and the validation and encoding of admission rows live in `engine.sheets.inputs`,
  those of outcomes in `engine.sheets.outcome_inputs`.
This module does no I/O.
"""

from __future__ import annotations

import math
import re
from typing import Literal, Mapping, Sequence

import attrs

from ..limits.bounds import is_int
from .. import canonical
from ..values.codecs import (
    FLOAT, INT, INT32_MAX, MAP_SCOPE, RAW, STR, USER_JSON, dict_of, list_of, optional, record,
)
from ..errors import InvalidInputError
from ..limits.inputs import MAX_INPUT_INDEX, key_problem
from ..sql import SqlLiteral
from ..values.scopes import MapScope

from .field_names import clean_field

MAX_ATTEMPTS = 1_000_000  # calls one outcome may report (a row's `_attempts` is an integer)


class RowStatus(SqlLiteral):
    """A sheet row's `_status`: the one definition Python and SQL text both use (SQL writes
    `RowStatus.ENRICHED.sql`). Staleness is never stored: it is judged from cell policies."""

    PENDING = "pending"
    RUNNING = "running"
    ENRICHED = "enriched"
    FAILED = "failed"

    @property
    def counter(self) -> str:
        """The sheet counter (`Summary` field) of rows in this status, in users' words."""
        return COUNTER_OF_STATUS[self]


# Stored statuses -> the counters users read them by (a pending row is queued, an enriched one
# completed): the one mapping. `SUMMARY_COUNTERS`: every counter, in `Summary`'s order.
COUNTER_OF_STATUS: Mapping[RowStatus, str] = {
    RowStatus.PENDING: "queued", RowStatus.RUNNING: "running",
    RowStatus.ENRICHED: "completed", RowStatus.FAILED: "failed"}
SUMMARY_COUNTERS = ("total", *COUNTER_OF_STATUS.values())


class OutcomeStatus(SqlLiteral):
    """A row outcome's status, which is also the status its cells get in the cell meta."""

    COMPLETED = "completed"
    FAILED = "failed"


OUTCOME_STATUSES = tuple(status.value for status in OutcomeStatus)


class CellStatus(SqlLiteral):
    """An output cell's status in the cell meta, as `_cells[f].status` reports it: completion
    writes `completed` or `failed` (`OutcomeStatus`); a forced admission writes `pending`. Only
    a completed cell's value is shown (`reading.shown_cell`)."""

    COMPLETED = "completed"
    FAILED = "failed"
    PENDING = "pending"


_STATUS_FIELD = re.compile(r"\{(" + "|".join(status.name for status in RowStatus) + r")\}")


def with_row_statuses(template: str) -> str:
    """An SQL template with its row-status fields (`{PENDING}`, `{ENRICHED}`…) filled in as
    literals; its other fields are left for a later `format`."""
    return _STATUS_FIELD.sub(lambda m: RowStatus[m.group(1)].sql, template)


FENCE_REASONS = (
    "stale_write_version", "unadmitted", "attempt_superseded", "already_completed", "missing",
    "input_field",
)
BLOCK_REASONS = ("newer_run", "attempt_active", "gave_up")  # dispositions.Disposition's blocked
DEFAULT_ROW_ERROR = "Row execution failed."


def check_give_up_after(value: object) -> None:
    """`give_up_after`: None, or how many failed runs block a row (an integer column bounds
    it); the one check, wherever the value enters."""
    if value is not None and not is_int(value, 1, INT32_MAX):
        raise InvalidInputError(
            f"give_up_after must be an integer from 1 to {INT32_MAX} or None, got {value!r}")


MAX_SHEET_FIELDS = 400


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
        count = len(self.inputs) + len(self.outputs)
        if count > MAX_SHEET_FIELDS:
            raise InvalidInputError(
                f"SheetContract has {count} fields; a sheet holds at most {MAX_SHEET_FIELDS}"
            )
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


def _non_negative_int(name: str, high: int = 2**63 - 1):
    def check(_instance: object, _attribute: object, value: object) -> None:
        if not is_int(value, 0, high):
            raise InvalidInputError(f"{name} must be an integer from 0 to {high}, got {value!r}")

    return check


@attrs.frozen
class Attempt:
    """One scheduler attempt of a run. Admitted rows are leased to it for `lease_s` seconds.

    Fences compare `attempt_id`s; `seq` is recorded with the lease for diagnosis. A lease of 0 s
    is admitted already expired (another attempt may take the row over at once).
    """

    attempt_id: str = attrs.field(validator=_non_empty_str("Attempt.attempt_id"))
    seq: int = attrs.field(validator=_non_negative_int("Attempt.seq", 2**31 - 1))  # an integer column
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
    reason: Literal["newer_run", "attempt_active", "gave_up"]


@attrs.frozen
class Admission:
    """What `admit` did. `pending`, `completed` and `blocked` keep the input order.

    `inserted` counts new rows (also listed in `pending`); `skipped` counts duplicates of an
    earlier row of the same call; `cached` counts the cache hits — the rows listed in
    `completed`, or, when admission ran with `cache_hits="count"`, the hits it did not list
    (`completed` is then empty).
    """

    inserted: int
    skipped: int
    pending: tuple[AdmittedRow, ...]
    completed: tuple[AdmittedRow, ...]
    blocked: tuple[BlockedRow, ...]
    write_version: int
    timings: tuple[Timing, ...] = ()
    cached: int = 0


def _map_scope(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, MapScope):
        raise InvalidInputError(f"StagedPage.scope must be a MapScope, got {type(value).__name__}")


def _ordinal(_instance: object, _attribute: object, value: object) -> None:
    if not is_int(value, 0):
        raise InvalidInputError(f"StagedPage.ordinal must be an integer >= 0, got {value!r}")


def _digest(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, str) or len(value) != 64 or value.strip("0123456789abcdef"):
        raise InvalidInputError(f"StagedPage.digest must be 64 lowercase hex digits, got {value!r}")


@attrs.frozen
class StagedPage:
    """A sealed array-input page of the admitting run (`engine.array_input`), named by its map
    scope and ordinal, with the digest the caller computed for the rows it holds.

    Admitting with `staged_page=` reads the input cells from this stored page fact in the same
    statement that checks it, instead of receiving the rows again.
    """

    scope: MapScope = attrs.field(validator=_map_scope)
    ordinal: int = attrs.field(validator=_ordinal)
    digest: str = attrs.field(validator=_digest)


def _outcome_key(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, str):
        raise InvalidInputError(f"RowOutcome.key must be a string, got {type(value).__name__}")
    problem = key_problem(value)
    if problem is not None:
        raise InvalidInputError(f"RowOutcome.key {problem}")


def _plain_status(value: object) -> object:
    """An `OutcomeStatus` member as its plain text (what the wire and the checks expect)."""
    return value.value if isinstance(value, OutcomeStatus) else value


def _outcome_status(instance: RowOutcome, _attribute: object, value: object) -> None:
    if value not in OUTCOME_STATUSES:
        raise InvalidInputError(
            f"RowOutcome {instance.key!r}: status {value!r} is not one of {OUTCOME_STATUSES}"
        )


def _outcome_optional(kind: type, name: str):
    def check(instance: RowOutcome, _attribute: object, value: object) -> None:
        if value is not None and not isinstance(value, kind):
            raise InvalidInputError(
                f"RowOutcome {instance.key!r}: {name} must be a {kind.__name__} or None, "
                f"got {type(value).__name__}"
            )

    return check


def _outcome_attempts(instance: RowOutcome, _attribute: object, value: object) -> None:
    if not is_int(value, 1, MAX_ATTEMPTS):
        raise InvalidInputError(
            f"RowOutcome {instance.key!r}: attempts must be an integer from 1 to {MAX_ATTEMPTS}"
        )


def _outcome_index(instance: RowOutcome, _attribute: object, value: object) -> None:
    if value is not None and not is_int(value, 0, MAX_INPUT_INDEX):
        raise InvalidInputError(
            f"RowOutcome {instance.key!r}: input_index must be an integer >= 0 (at most "
            f"{MAX_INPUT_INDEX}) or None"
        )


class _EncodedOutcome:
    """A slot that is not an attrs field (not compared, shown, copied, pickled or sent): a
    completed outcome as completion prepares it (its data's patch text and names), set only by
    `engine.sheets.outcome_inputs.completed_outcome`, which normalized and encoded the data itself.
    An outcome built any other way (the constructor, `attrs.evolve`, a copy, the wire) has
    none, and `prepare_outcomes` checks and encodes its data."""

    __slots__ = ("_encoded",)


@attrs.frozen
class RowOutcome(_EncodedOutcome):
    """The result of running the map function on one admitted row.

    `data` patches the row's cells (only the keys present); `cell_meta` maps field names to
    objects merged into the row's cell meta; `error` is the failed row's message; `cause` its
    cause (`sheets.causes.cause_of` of the message and the row's inputs, computed where the
    inputs are known; None: completion takes the message's own); `attempts` is how many calls
    of the function this outcome took (added to the row's `_attempts`).
    """

    key: str = attrs.field(validator=_outcome_key)
    status: str = attrs.field(converter=_plain_status, validator=_outcome_status)
    data: dict | None = attrs.field(default=None, validator=_outcome_optional(dict, "data"))
    input_index: int | None = attrs.field(default=None, validator=_outcome_index)
    cell_meta: dict | None = attrs.field(
        default=None, validator=_outcome_optional(dict, "cell_meta")
    )
    error: str | None = attrs.field(default=None, validator=_outcome_optional(str, "error"))
    attempts: int = attrs.field(default=1, validator=_outcome_attempts)
    cause: str | None = attrs.field(default=None, validator=_outcome_optional(str, "cause"))


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
    """Counters of a sheet: all rows, the rows of each status (`RowStatus.counter`: pending
    rows are `queued`, enriched ones `completed`); per field, cells completed / failed."""

    total: int
    queued: int
    running: int
    completed: int
    failed: int
    columns: Mapping[str, ColumnSummary] = attrs.field(factory=dict)


# -- wire codecs (engine.actions) -------------------------------------------------------------
CONTRACT = record(SheetContract, inputs=list_of(STR), outputs=list_of(STR))
ATTEMPT = record(Attempt, attempt_id=STR, seq=INT, lease_s=FLOAT)
CELL_POLICIES = dict_of(record(CellPolicy, stale_after_s=FLOAT))
ROW_OUTCOME = record(RowOutcome, key=STR, status=STR, data=optional(USER_JSON),
                     input_index=optional(INT), cell_meta=optional(USER_JSON), error=optional(STR),
                     attempts=INT, cause=optional(STR))
_ADMITTED = record(AdmittedRow, key=STR, input_index=INT, row=RAW)
ADMISSION = record(
    Admission, inserted=INT, skipped=INT, pending=list_of(_ADMITTED, as_tuple=True),
    completed=list_of(_ADMITTED, as_tuple=True),
    blocked=list_of(record(BlockedRow, key=STR, input_index=INT, reason=STR), as_tuple=True),
    write_version=INT, timings=list_of(record(Timing, default=RAW), as_tuple=True), cached=INT,
)
STAGED_PAGE = record(StagedPage, scope=MAP_SCOPE, ordinal=INT, digest=STR)
COMPLETION = record(
    Completion, updated=INT, committed_keys=list_of(STR, as_tuple=True),
    fenced=list_of(record(FencedRow, key=STR, reason=STR, row_write_version=optional(INT)),
                   as_tuple=True),
    diagnostics=optional(record(CompletionDiagnostics, default=RAW)),
)
SUMMARY = record(Summary, total=INT, queued=INT, running=INT, completed=INT, failed=INT,
                 columns=dict_of(record(ColumnSummary, completed=INT, failed=INT)))
