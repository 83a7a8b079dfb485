"""How many database sessions an org may hold, and which public keys a session URL may be
encrypted to: both checked before a session role exists (`engine.sessions.mint` / `create`).

- An org holds at most `sessions_per_org()` live sessions (`RUNPLANE_SESSIONS_PER_ORG`, default
  4): a session role counts until its `VALID UNTIL` passes. Past it, `TooManySessionsError`
  (HTTP 429) with the seconds until the org's oldest session expires.
- A runner's public key is refused (`InvalidInputError`, HTTP 400) when it is over
  `MAX_JWK_BITS` or cannot encrypt, so a refused key never leaves a minted role behind.
"""

from __future__ import annotations

import os
from typing import Any

from . import jwe, pg
from .errors import InvalidInputError, TooManySessionsError
from .session_isolation import SCOPES_TABLE
from .sql import qualified

DEFAULT_SESSIONS_PER_ORG = 4
SESSIONS_PER_ORG_ENV = "RUNPLANE_SESSIONS_PER_ORG"
MAX_JWK_BITS = 8192

# Mints of one schema take turns (a mint is a few milliseconds), so the live sessions an org
# holds are counted exactly; sessions themselves cannot take this lock mode on the table.
_LIVE_SESSIONS = """
SELECT count(*) AS live,
       extract(epoch FROM min(r.rolvaliduntil) - clock_timestamp())::float8 AS first_expiry_s
  FROM {m} AS m
  JOIN pg_catalog.pg_roles AS r ON r.rolname = m.role_name
 WHERE m.org_id = $1 AND r.rolvaliduntil > clock_timestamp()
"""


def sessions_per_org() -> int:
    """The most live sessions one org may hold: `RUNPLANE_SESSIONS_PER_ORG`, else 4."""
    raw = os.environ.get(SESSIONS_PER_ORG_ENV, "")
    if not raw:
        return DEFAULT_SESSIONS_PER_ORG
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise InvalidInputError(f"{SESSIONS_PER_ORG_ENV} must be an integer from 1 to 10000")
    return int(raw)


async def check_room(conn: pg.Connection, schema: str, org_id: str, max_sessions: int) -> None:
    """Refuse with `TooManySessionsError` when the org holds `max_sessions` live sessions."""
    m = qualified(schema, SCOPES_TABLE)
    await conn.execute(f"LOCK TABLE {m} IN SHARE ROW EXCLUSIVE MODE")
    row = await conn.fetchrow(_LIVE_SESSIONS.format(m=m), org_id)
    if row["live"] >= max_sessions:
        wait = max(1.0, float(row["first_expiry_s"] or 1.0))
        raise TooManySessionsError(
            f"org {org_id!r} already holds {row['live']} live database sessions (at most "
            f"{max_sessions}); the next one can be minted in {wait:.0f} s",
            retry_after_s=wait)


def check_public_key(public_key: Any) -> None:
    """Refuse a key the answer could not be encrypted to, before any role exists."""
    jwe.load_public_jwk(public_key)  # names the member that is wrong
    bits = int.from_bytes(jwe.b64url_decode(public_key["n"], "public_key.n"), "big").bit_length()
    if bits > MAX_JWK_BITS:
        raise InvalidInputError(f"public_key.n must be an RSA modulus of at most {MAX_JWK_BITS} bits")
    try:
        jwe.encrypt(b"probe", public_key)
    except InvalidInputError:
        raise
    except Exception as exc:  # whatever the cryptography refuses, the runner's key is at fault
        raise InvalidInputError(f"public_key cannot encrypt: {exc}") from None
