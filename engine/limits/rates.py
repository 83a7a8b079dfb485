"""Shared rate limits: token buckets kept in the tenant database, leased in batches.

How it works
- A bucket is one row of `rate_limits`, keyed by (org, key): the tokens it held at
  `updated_at`. Tokens accrue at the caller's `per_second` up to `burst`, on the server's
  clock, so every process sharing the key sees one bucket and one clock.
- `lease(port, org_id, key, per_second=..., burst=..., want=n)` is one statement: it creates the
  bucket full if absent, refills it for the time elapsed, and takes `want` tokens when that
  many are there — all or nothing, so a caller never leases in dribbles — returning
  `Lease(granted, retry_after_s)`: when nothing was granted, how long until `want` tokens will
  have accrued (the caller sleeps, then leases again). Tokens a caller leased and never used
  are lost with it (a process that dies never returns them), so the bucket never over-issues:
  the calls made under a key never exceed `burst + per_second × elapsed`.
- Callers sharing a key should agree on `per_second` and `burst`; each lease refills with the
  values it was given.
"""

from __future__ import annotations


import attrs

from .bounds import is_int, is_number
from ..actions import action
from ..values.codecs import FLOAT, INT, STR, record
from ..errors import InvalidInputError, ScopeError
from ..ports import Port, table, with_connection

LANE = "receipts"  # a lease is one short statement, like a receipt; never behind sheet writes
MAX_KEY_BYTES = 256

_AVAILABLE = ("least($4::float8, r.tokens + $3::float8"
              " * greatest(0, extract(epoch FROM now() - r.updated_at)::float8))")
_TAKEN = f"CASE WHEN {_AVAILABLE} >= $5::integer THEN $5::integer ELSE 0 END"

_LEASE = f"""
INSERT INTO {{t}} AS r (org_id, key, tokens, granted, updated_at)
VALUES ($1, $2, $4::float8 - $5::integer, $5::integer, now())
ON CONFLICT (org_id, key) DO UPDATE
   SET tokens = {_AVAILABLE} - {_TAKEN}, granted = {_TAKEN}, updated_at = now()
RETURNING granted, tokens
"""


@attrs.frozen
class Lease:
    """Tokens granted by one lease; when none, seconds until a lease of that size can succeed."""

    granted: int
    retry_after_s: float


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key.strip():
        raise InvalidInputError(f"rate limit key must be a non-empty string, got {key!r}")
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        raise InvalidInputError(f"rate limit key is longer than {MAX_KEY_BYTES} UTF-8 bytes")
    if any(ord(ch) < 32 or ord(ch) == 127 or 0xD800 <= ord(ch) <= 0xDFFF for ch in key):
        raise InvalidInputError("rate limit key holds a control character or a lone surrogate")
    return key


def _check(port: Port, org_id: str, key: str, per_second: float, burst: float, want: int) -> None:
    if org_id != port.org_id:
        raise ScopeError(f"org {org_id!r} is outside the execution scope (org {port.org_id!r})")
    check_key(key)
    for name, value in (("per_second", per_second), ("burst", burst)):
        if not is_number(value, above=0, finite=True):
            raise InvalidInputError(f"{name} must be a finite number > 0, got {value!r}")
    if not is_int(want, 1, burst):
        raise InvalidInputError(f"want must be an integer from 1 to burst ({burst}), got {want!r}")


@action("rate_limits.lease", params={
    "org_id": STR, "key": STR, "per_second": FLOAT, "burst": FLOAT, "want": INT,
}, result=record(Lease, granted=INT, retry_after_s=FLOAT), deadline_s=10.0)
async def lease(port: Port, org_id: str, key: str, *, per_second: float, burst: float,
                want: int) -> Lease:
    """Take `want` tokens from the shared bucket `key` of `org_id`, or none (one statement)."""
    _check(port, org_id, key, per_second, burst, want)
    sql = _LEASE.format(t=table(port, "rate_limits"))

    async def op(conn):
        return await conn.fetchrow(sql, org_id, key, float(per_second), float(burst), want)

    row = await with_connection(port, LANE, op)
    granted, tokens = row["granted"], row["tokens"]
    if granted:
        return Lease(granted, 0.0)
    return Lease(0, max(0.0, (want - tokens) / per_second))
