"""The schema's lock secret, and the advisory-lock keys derived from it.

The bootstrap (`engine.schema`) stores one random secret per schema in `LOCK_SECRET_TABLE`, which
no database session may read. `lock_material` reads what a login may know of it at open: the
secret itself (the owner's login, the gateway's), or, for a database session, its own sheet's
key from its scope row. `derive_lock_key` keys an advisory lock by the secret, so that nobody
without it can tell which key guards what.
"""

from __future__ import annotations

import hashlib
import hmac

from .errors import InsufficientPrivilegeError
from .sql import qualified

LOCK_SECRET_TABLE = "lock_secret"


def derive_lock_key(secret: bytes, *parts: str) -> int:
    """A signed 64-bit advisory-lock key for `parts`, keyed by the schema's lock secret: without
    the secret nobody can tell which key guards what."""
    digest = hmac.new(secret, "\x00".join(parts).encode("utf-8"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


# Whether this login may read the lock secret table `$n` (false when it does not exist yet).
SECRET_READABLE = "coalesce(has_table_privilege(to_regclass(${n}), 'SELECT'), false)"


async def _readable_secret(conn, schema: str) -> bytes | None:
    """The schema's lock secret, or None (no such table or row yet, or not ours to read)."""
    secret_table = qualified(schema, LOCK_SECRET_TABLE)
    readable = await conn.fetchval(f"SELECT {SECRET_READABLE.format(n=1)}", secret_table)
    if not readable:
        return None
    return await conn.fetchval(f"SELECT secret FROM {secret_table}")


async def lock_material(conn, schema: str) -> tuple[bytes | None, dict[str, int]]:
    """`(secret, {})` for a login that may read the schema's lock secret; for a database
    session, `(None, {its sheet table: its key})` from its own scope row."""
    secret = await _readable_secret(conn, schema)
    if secret is not None:
        return secret, {}
    try:
        rows = await conn.fetch(
            f"SELECT sheet_table, sheet_lock_key FROM {qualified(schema, 'session_scopes')}"
            " WHERE role_name = current_user AND sheet_lock_key IS NOT NULL")
    except InsufficientPrivilegeError:
        return None, {}
    return None, {row["sheet_table"]: row["sheet_lock_key"] for row in rows}
