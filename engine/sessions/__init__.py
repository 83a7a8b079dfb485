"""Database sessions: short-lived PostgreSQL logins confined to one org's play, table namespace
and operations (docs/guide/sessions.md), handed to runners so covered work skips the gateway's HTTP hop.

What is where
- `minting`: mint a session role, describe it (its URL, its key ranges), the gateway action
  `db_sessions.create`, and `password_probe` for `runplane doctor`.
- `grants`: what each operation grants a session role (the GRANT statements; no I/O).
- `isolation`: how the database keeps a session inside its org (row-level security and the
  session group role), installed by the schema bootstrap (`engine.schema`).
- `limits`: the session budgets: how many live sessions an org and a server may hold, which
  public keys a URL may be sealed to, what one session may carry (`SessionLimits`,
  `SessionUsage`), the role timeouts, and the connection plan the embedded server is sized by.
  They live here, not in `engine.limits`, because each is counted over session roles.
- `sweep`: ending expired and overdue sessions (the gateway and `runplane supervise` run it).
- `jwe`: sealing a session's URL to the runner's public key (pure).

Who may call: the gateway (the server mints and sweeps; the client's `db_sessions` router uses
the sessions it gets), the schema bootstrap (`isolation`), the embedded server (`limits`), and
the command line. This package imports nothing above the engine's root modules except
`engine.sheets` (a session's sheet is ensured when it is minted). Import the names below from
`engine.sessions`; inside this package, modules import each other directly.
"""

from .grants import OPERATIONS
from .isolation import GROUP
from .limits import DEFAULT_SESSIONS_PER_ORG, SESSIONS_PER_ORG_ENV, SessionLimits
from .minting import (
    CREATE_ACTION,
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_TTL_S,
    MintContext,
    MintedSession,
    SessionScope,
    create,
    key_ranges,
    mint,
    operation_actions,
    password_probe,
)
from .credentials import session_url
from .sweep import drop_expired, sweep_expired

__all__ = [
    "mint", "create", "password_probe", "operation_actions", "session_url", "key_ranges",
    "SessionScope", "MintContext", "MintedSession", "CREATE_ACTION", "DEFAULT_TTL_S", "DEFAULT_CONNECTION_LIMIT",
    "OPERATIONS", "GROUP", "SessionLimits", "DEFAULT_SESSIONS_PER_ORG", "SESSIONS_PER_ORG_ENV",
    "drop_expired", "sweep_expired",
]
