"""The gateway: every runtime action over HTTP, for runners that hold a token instead of
database credentials.

`open_server` serves the actions of `engine.actions` (`server`, its tenants in `tenants`); `open_gateway` yields a
`Gateway`, accepted by every engine operation and by the actors wherever a tenant is
(`client`: `transport` sends, `retry` decides each retry, `senders` pages admission and
completion under the body limit with `paging`); `mint_token` makes the scoped tokens
(`engine.tokens`, below both the gateway and the console, which check them); `protocol` is the
wire format; `db_sessions` runs covered work over database sessions.
"""

from .db_sessions import DbSession, create_db_session
from .client import Gateway, Health, open_gateway
from .transport import GatewayStats
from .retry import RetryPolicy
from .protocol import DEFAULT_BODY_LIMIT
from .server import Server, ServerOptions, open_server
from ..tokens import TokenClaims, mint_token, verify_token

__all__ = [
    "mint_token", "verify_token", "TokenClaims", "open_server", "Server", "ServerOptions", "open_gateway",
    "Gateway", "GatewayStats", "create_db_session", "DbSession", "Health", "RetryPolicy", "DEFAULT_BODY_LIMIT",
]
