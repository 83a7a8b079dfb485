"""Who may look: console sessions, the gateway-token login and the one-time login link.

How it works
- A session is a random id in an HttpOnly, SameSite=Strict cookie (`COOKIE`, path `/ui`) that
  maps, in the serving process's memory, to a `Viewer`: the one org it may see (None: every org)
  and its plays (`*`: every play), until an expiry. Nothing else is trusted from the browser.
- `runplane serve`: `POST /ui/login` with the form field `token` verifies a gateway token
  (signature, expiry) and requires its `actions` claim to allow the console's reads
  (`CONSOLE_ACTIONS`); the session then sees the token's org and plays and ends when the
  token expires.
- `runplane console`: a one-time code (`?once=CODE` on `/ui/login`) opens a session that sees
  every org; the code works once, then never again.
- Sessions are bounded (`MAX_SESSIONS`; the oldest go first) and expire (`SESSION_TTL_S` for a
  one-time link's session). Tokens and codes are never logged or shown.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time

import attrs

from ..errors import AuthError, ScopeError
from ..gateway.tokens import verify_token

COOKIE = "runplane_console"
COOKIE_PATH = "/ui"
MAX_SESSIONS = 10_000
SESSION_TTL_S = 12 * 3600.0
CONSOLE_ACTIONS = ("runs.list_runs", "sheets.summary", "sheets.read_page", "sheets.failed_rows")


@attrs.frozen
class Viewer:
    """What one session may see: `org` (None: every org) and `plays` (`*`: every play)."""

    org: str | None
    plays: tuple[str, ...]
    expires_at: float

    @property
    def every_play(self) -> bool:
        return "*" in self.plays

    @property
    def play_filter(self) -> tuple[str, ...] | None:
        """The plays to filter listings by (None: no filter)."""
        return None if self.every_play else self.plays

    def sees_org(self, org: str) -> bool:
        return self.org is None or self.org == org

    def sees(self, org: str, play: str) -> bool:
        return self.sees_org(org) and (self.every_play or play in self.plays)


@attrs.define(eq=False)
class Sessions:
    """Console sessions and one-time login codes, in memory."""

    secret: str | None = attrs.field(default=None, repr=False)  # gateway tokens' secret
    _sessions: "collections.OrderedDict[str, Viewer]" = attrs.field(
        init=False, factory=collections.OrderedDict, repr=False)
    _codes: set[str] = attrs.field(init=False, factory=set, repr=False)

    def new_code(self) -> str:
        """A one-time login code (valid once, for a session that sees every org)."""
        code = secrets.token_urlsafe(24)
        self._codes.add(code)
        return code

    def redeem(self, code: str) -> str:
        """A new session id for a valid one-time code (which is used up), else `AuthError`."""
        for known in list(self._codes):
            if hmac.compare_digest(known.encode(), code.encode()):
                self._codes.discard(known)
                return self._open(Viewer(None, ("*",), time.time() + SESSION_TTL_S))
        raise AuthError("this login link is not valid or was already used")

    def login(self, token: str) -> str:
        """A new session id for a gateway token that may read the console, else `AuthError`
        (bad token) or `ScopeError` (a token whose actions do not include the reads)."""
        if self.secret is None:
            raise AuthError("this console logs in with its one-time link, not with a token")
        claims = verify_token(self.secret, token.strip() or None)
        for name in CONSOLE_ACTIONS:
            claims.check_action(name)
        return self._open(Viewer(claims.org, claims.plays, float(claims.exp)))

    def viewer(self, session_id: str | None) -> Viewer | None:
        """The viewer of a session cookie, or None (no cookie, unknown, expired)."""
        if not session_id:
            return None
        viewer = self._sessions.get(session_id)
        if viewer is None:
            return None
        if viewer.expires_at <= time.time():
            self._sessions.pop(session_id, None)
            return None
        return viewer

    def logout(self, session_id: str | None) -> None:
        if session_id:
            self._sessions.pop(session_id, None)

    def _open(self, viewer: Viewer) -> str:
        session_id = secrets.token_urlsafe(32)
        self._sessions[session_id] = viewer
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session_id


__all__ = ["Viewer", "Sessions", "COOKIE", "COOKIE_PATH", "CONSOLE_ACTIONS", "AuthError",
           "ScopeError"]
