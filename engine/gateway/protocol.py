"""The gateway's wire protocol: paths, headers, JSON bodies and the error table.

How it works
- `POST {url}/v1/actions/{action}` carries the action's input as one JSON object and answers
  `{"result": ...}` (200) or an error object `{"error": message, "code": code, "action": name}`
  (plus `retry_after_ms` when a retry should wait, `sqlstate` for a database error).
  `GET {url}/v1/health` answers `{"ok", "version", "body_limit", "array_actions"}`.
- `ERRORS` is the one table both sides use: the server turns an exception into a code and a
  status (`error_status`), the client turns a code back into the same `engine.errors` class a
  direct call would have raised (`error_from`).
- `ROWS_HEADER: by-key` on a `sheets.admit` request says the client keeps the rows it sent: the
  server answers each pending row with its key and input index only (`row` is `{}`), and the
  client puts its own copy back. Rows then cross the wire once; a server that ignores the
  header answers in full, which the client treats the same way. `by-index` (to a gateway
  that lists it, for a page whose input indexes are distinct and that asks no previous cells:
  a page of rows, or a staged page, one request either way) answers each pending row as its
  input index alone.
- `REQUEST_ID_HEADER` carries one id per operation (the same on every retry of it): a server
  answers a retry of a write it already applied from its replay cache, so a reply lost after
  the commit changes nothing, not even the answer.
This module does no I/O.
"""

from __future__ import annotations

import json
import re
from typing import Mapping

from ..canonical import JsonObject, JsonValue
from ..limits.bounds import is_number
from ..errors import (
    ArrayInputUnavailableError,
    AuthError,
    ConflictError,
    LeaseLostError,
    CorruptFactError,
    DatabaseError,
    EngineError,
    GatewayUnavailableError,
    InvalidInputError,
    MissingRelationError,
    RetiredError,
    ScopeError,
    StatementTimeoutError,
    StoreUnavailableError,
    TenantUnavailableError,
    TooManySessionsError,
    TransactionStateUnknownError,
)

ACTIONS_PATH = "/v1/actions/"
HEALTH_PATH = "/v1/health"
REQUEST_ID_HEADER = "runplane-request-id"
ROWS_HEADER = "runplane-rows"
ROWS_BY_KEY = "by-key"
ROWS_BY_INDEX = "by-index"
ROWS_FORMS = frozenset({ROWS_BY_KEY, ROWS_BY_INDEX})
DEFAULT_BODY_LIMIT = 4_450_000
PAGE_HEADROOM = 4 * 1024  # a paged request stays this far under the body limit
MIN_BODY_LIMIT = 2 * PAGE_HEADROOM  # the smallest body limit a gateway may have
# A client that has not read the gateway's health sends this header (any value) with an action
# whose body fits `MIN_BODY_LIMIT`; a gateway that knows it answers a 200 with its health answer
# (`health_answer`, compact JSON) in the same-named header, sparing `GET /v1/health` a round
# trip. An older gateway answers without it, and the client reads `HEALTH_PATH` when it needs to.
HEALTH_HEADER = "runplane-health"

# code, HTTP status, class (most specific first: the server picks the first class that matches)
ERRORS: tuple[tuple[str, int, type[EngineError]], ...] = (
    ("invalid_input", 400, InvalidInputError),
    ("unauthenticated", 401, AuthError),
    ("scope_denied", 403, ScopeError),
    ("lease_lost", 409, LeaseLostError),
    ("conflict", 409, ConflictError),
    ("retired", 410, RetiredError),
    ("corrupt_fact", 500, CorruptFactError),
    ("transaction_state_unknown", 500, TransactionStateUnknownError),
    ("tenant_unavailable", 503, TenantUnavailableError),
    ("store_unavailable", 503, StoreUnavailableError),
    ("missing_relation", 500, MissingRelationError),
    ("statement_timeout", 500, StatementTimeoutError),
    ("database_error", 500, DatabaseError),
    ("array_input_unavailable", 400, ArrayInputUnavailableError),
    ("too_many_sessions", 429, TooManySessionsError),
    ("internal", 500, EngineError),
)
UNSUPPORTED_ACTION = ("unsupported_action", 400)
# What a gateway does beyond the protocol's first form, listed in its health answer
# (`features`): a client sends a newer form only to a gateway that lists it, so a newer runner
# works against an older gateway (which lists nothing) with the older requests.
OPEN_LIST_MAP = "array_input.open_list_map"  # the action (else: three calls)
PUT_AND_SEAL_BEGINS = "array_input.put_and_seal:begins"  # its begin fields (else: begin first)
RETIRE_RECORDS = "array_input.retire_entry:records"  # `record_lease_s` (else: mark_pending first)
ARRAY_FEATURES = (OPEN_LIST_MAP, PUT_AND_SEAL_BEGINS, RETIRE_RECORDS)  # listed with array actions
ADMIT_EXPECT_NEW = "sheets.admit:expect_new"  # its `expect_new` field (else: not sent)
ADMIT_BY_INDEX = "sheets.admit:by-index"  # `ROWS_HEADER: by-index` (else: by-key)
FEATURES = (ADMIT_EXPECT_NEW, ADMIT_BY_INDEX)  # listed always
BODY_TOO_LARGE = ("body_too_large", 413)
RETRYABLE_STATUSES = frozenset({408, 429, 502, 503, 504})
TRANSIENT_MESSAGE = re.compile(
    r"timed out|timeout|connection (?:was )?(?:reset|refused|closed|lost)|econnreset|econnrefused"
    r"|temporarily unavailable|terminat", re.IGNORECASE)

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False,
                            check_circular=False)


def dumps(value: JsonValue) -> bytes:
    """Compact UTF-8 JSON of a wire value."""
    return _encoder.encode(value).encode("utf-8")


def health_answer(version: str, body_limit: int, array_actions: bool) -> JsonObject:
    """`GET /v1/health`'s body: the gateway's version, its body limit, whether it serves
    array-input actions, and the newer forms it takes (`features`)."""
    return {"ok": True, "version": version, "body_limit": body_limit,
            "array_actions": array_actions,
            "features": list(FEATURES + (ARRAY_FEATURES if array_actions else ()))}


def error_status(exc: BaseException) -> tuple[str, int]:
    for code, status, cls in ERRORS:
        if isinstance(exc, cls):
            return code, status
    return "internal", 500


def error_body(message: str, code: str, action: str | None, **extra: JsonValue) -> bytes:
    body: JsonObject = {"error": message, "code": code, "action": action}
    body.update({key: value for key, value in extra.items() if value is not None})
    return dumps(body)


def is_retryable(status: int, payload: dict) -> bool:
    """Whether an answered failure is worth another attempt."""
    if payload.get("code") == "too_many_sessions":
        return False  # the caller sends that work over HTTP instead of waiting
    if status in RETRYABLE_STATUSES:
        return True
    return status == 500 and payload.get("code") not in ("transaction_state_unknown", "corrupt_fact") \
        and TRANSIENT_MESSAGE.search(str(payload.get("error", ""))) is not None


def retry_after_s(payload: JsonObject, headers: Mapping[str, str] | None,
                  default: float | None = 0.0) -> float | None:
    """The wait a server asked for, from `retry_after_ms` or a `Retry-After` header (seconds);
    `default` when it asked for none."""
    value = payload.get("retry_after_ms")
    if is_number(value, 0):
        return float(value) / 1000.0
    header = headers.get("retry-after") if headers is not None else None
    if header:
        try:
            return max(0.0, float(header))
        except ValueError:
            return 0.0
    return default


def error_from(status: int, payload: dict, action: str, where: str) -> EngineError:
    """The `engine.errors` exception an error answer stands for (the server's message, plus
    where it came from)."""
    code = payload.get("code")
    message = str(payload.get("error") or f"HTTP {status}")
    if code == UNSUPPORTED_ACTION[0]:
        if action.startswith("array_input."):
            return ArrayInputUnavailableError(f"{message} ({where} has no array-input actions)")
        return EngineError(f"{message} ({where})")
    if code == BODY_TOO_LARGE[0]:
        return InvalidInputError(f"{message} ({where})")
    for known, _status, cls in ERRORS:
        if code == known:
            if cls is TransactionStateUnknownError:
                return TransactionStateUnknownError(
                    message, error=EngineError(message),
                    rollback_error=EngineError("reported by the gateway"))
            if issubclass(cls, DatabaseError):
                return cls(message, sqlstate=payload.get("sqlstate"))
            if cls is TooManySessionsError:
                return cls(message, retry_after_s=retry_after_s(payload, None) or 1.0)
            return cls(message)
    if status in RETRYABLE_STATUSES:
        return GatewayUnavailableError(f"{where} answered HTTP {status}: {message}")
    return EngineError(f"{where} answered HTTP {status}: {message}")
