"""Transaction-mode poolers: PgBouncer's `pool_mode = transaction` and hosted poolers like it.

Such a pooler lends a server connection to a client for one transaction at a time, so nothing
a session sets survives between transactions, and another client's session state may be
waiting on the server connection a statement lands on. With `RUNPLANE_POOLER=transaction`
(or `?pooler=transaction` in the DSN; the DSN wins) runplane keeps no session state:
- no startup parameters the pooler refuses (the search path is not sent at connect);
- no named prepared statements (asyncpg's statement cache is off; its unnamed statements are
  parsed, bound and executed before one Sync, which a pooler keeps on one server connection);
- every checkout is one transaction that first runs `SET LOCAL search_path` (and `SET LOCAL
  ROLE` under an execution role), so no statement runs outside a transaction or with a search
  path another client left behind (`engine.tenant.Checkout`);
- advisory locks are transaction-scoped, and nothing LISTENs.

Without the setting, the pooler's first symptom (a refused startup parameter, or a prepared
statement the next server connection does not have) is reported as one line naming it
(`pooler_hint`). This module does no I/O.
"""

from __future__ import annotations

import enum
import os
import urllib.parse

from ..errors import InvalidInputError

POOLER_ENV = "RUNPLANE_POOLER"
POOLER_PARAM = "pooler"
SETTING = f"{POOLER_ENV}=transaction (or ?{POOLER_PARAM}=transaction in the DSN)"


class PoolerMode(enum.StrEnum):
    """What stands between runplane and the server."""

    NONE = "none"                # the server itself, or a session-mode pooler
    TRANSACTION = "transaction"  # a transaction-mode pooler


def _query_mode(dsn: str) -> str | None:
    if "://" not in dsn:
        return None
    values = urllib.parse.parse_qs(urllib.parse.urlsplit(dsn).query).get(POOLER_PARAM)
    return values[-1] if values else None


def pooler_mode(dsn: str) -> PoolerMode:
    """The DSN's `pooler` parameter, else `RUNPLANE_POOLER`, else none; `InvalidInputError`
    for another value (`session` means none: a session-mode pooler keeps session state)."""
    given = _query_mode(dsn)
    source = f"the DSN's {POOLER_PARAM} parameter"
    if given is None:
        given, source = os.environ.get(POOLER_ENV) or "none", POOLER_ENV
    value = given.strip().lower()
    if value in ("", "none", "session", "off"):
        return PoolerMode.NONE
    if value == "transaction":
        return PoolerMode.TRANSACTION
    raise InvalidInputError(f"{source} must be 'transaction' or 'none', got {given!r}")


def without_pooler_param(dsn: str) -> str:
    """The DSN without its `pooler` parameter (the driver would send it to the server as a
    setting)."""
    if "://" not in dsn or f"{POOLER_PARAM}=" not in dsn:
        return dsn
    url = urllib.parse.urlsplit(dsn)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(url.query, keep_blank_values=True)
             if k != POOLER_PARAM]
    return urllib.parse.urlunsplit(url._replace(query=urllib.parse.urlencode(query, safe="/,")))


# What a transaction-mode pooler answers a client that keeps session state.
_SYMPTOMS = ("unsupported startup parameter", "prepared statement", "does not exist")


def pooler_hint(message: str) -> str | None:
    """The one line to show for a driver error that is a transaction-mode pooler's symptom
    (None for any other error)."""
    lowered = message.lower()
    refused = _SYMPTOMS[0] in lowered
    lost_statement = _SYMPTOMS[1] in lowered and _SYMPTOMS[2] in lowered
    if not (refused or lost_statement):
        return None
    return (f"the server looks like a transaction-mode pooler ({message.strip()}): "
            f"set {SETTING}")
