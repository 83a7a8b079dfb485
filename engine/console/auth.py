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
- Sessions are capped per org (`MAX_ORG_SESSIONS`): an org's login past its cap ends that org's
  oldest session, never another org's. Every org's sessions together are bounded too
  (`MAX_SESSIONS`, memory): past it, the org holding the most sessions loses its oldest, so an
  org with fewer sessions than any other is never the one logged out. (The sessions of
  `runplane console`, which see every org, count as one more org.) Sessions expire
  (`SESSION_TTL_S` for a one-time link's session, the token's `exp` for a token's).
- A token's `runs` claim, when it has one, limits the session to those runs (`Viewer.runs`);
  its `actions` claim says which console actions the session may take (`Viewer.may`: e.g.
  `runs.cancel`; a one-time link's session may take every one). Each session has its own
  random form token (`Sessions.csrf`) that every action form carries (`console.actions`).
- A session that ends (logout, eviction) sets its `ended` event, so a live stream of it stops at
  once; one that expires is seen as ended from its `expires_at`. Tokens and codes are never
  logged or shown.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time

import attrs
import trio

from ..errors import AuthError, ScopeError
from ..tokens import allows, verify_token

COOKIE = "runplane_console"
COOKIE_PATH = "/ui"
MAX_ORG_SESSIONS = 1_000  # one org's live sessions
MAX_SESSIONS = 100_000  # every org's together (a memory bound: past it the largest org yields)
SESSION_TTL_S = 12 * 3600.0
CONSOLE_ACTIONS = ("runs.list_runs", "sheets.summary", "sheets.read_page", "sheets.failed_rows")


@attrs.frozen
class Viewer:
    """What one session may see: `org` (None: every org), `plays` (`*`: every play) and `runs`
    (None: every run; else only those run ids), until `expires_at` (epoch seconds)."""

    org: str | None
    plays: tuple[str, ...]
    expires_at: float
    runs: tuple[str, ...] | None = None
    actions: tuple[str, ...] = ("*",)  # the token's action claims (a one-time link's: every one)

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

    def sees_run(self, run_id: str) -> bool:
        return self.runs is None or run_id in self.runs

    def may(self, action: str) -> bool:
        """Whether the session's action claims allow `action` (`runs.cancel`, ...)."""
        return allows(self.actions, action)


@attrs.define(eq=False)
class _Session:
    viewer: Viewer
    ended: trio.Event = attrs.field(factory=trio.Event)
    # the session's token for its action forms (`console.actions`): random, in its pages only
    csrf: str = attrs.field(factory=lambda: secrets.token_urlsafe(24), repr=False)


@attrs.define(eq=False)
class Sessions:
    """Console sessions and one-time login codes, in memory (see the module docstring)."""

    secret: str | None = attrs.field(default=None, repr=False)  # gateway tokens' secret
    # org (None: a session of every org) -> its sessions, oldest first
    _by_org: "dict[str | None, collections.OrderedDict[str, _Session]]" = attrs.field(
        init=False, factory=dict, repr=False)
    _org_of: dict[str, str | None] = attrs.field(init=False, factory=dict, repr=False)
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
        return self._open(Viewer(claims.org, claims.plays, float(claims.exp), claims.runs,
                                 claims.actions))

    def viewer(self, session_id: str | None) -> Viewer | None:
        """The viewer of a session cookie, or None (no cookie, unknown, expired)."""
        session = self._session(session_id)
        return None if session is None else session.viewer

    def csrf(self, session_id: str | None) -> str | None:
        """The action-form token of a live session, or None."""
        session = self._session(session_id)
        return None if session is None else session.csrf

    def ended(self, session_id: str | None) -> trio.Event | None:
        """The event a live session's end (logout, eviction) sets; None when it is not live."""
        session = self._session(session_id)
        return None if session is None else session.ended

    def logout(self, session_id: str | None) -> None:
        if session_id and session_id in self._org_of:
            self._close(session_id)

    def count(self, org: str | None) -> int:
        """How many sessions `org` holds (expired ones included until they are seen)."""
        return len(self._by_org.get(org, ()))

    def _session(self, session_id: str | None) -> _Session | None:
        if not session_id or session_id not in self._org_of:
            return None
        session = self._by_org[self._org_of[session_id]][session_id]
        if session.viewer.expires_at <= time.time():
            self._close(session_id)
            return None
        return session

    def _open(self, viewer: Viewer) -> str:
        session_id = secrets.token_urlsafe(32)
        mine = self._by_org.setdefault(viewer.org, collections.OrderedDict())
        mine[session_id] = _Session(viewer)
        self._org_of[session_id] = viewer.org
        if len(mine) > MAX_ORG_SESSIONS:
            self._close(next(iter(mine)))
        while len(self._org_of) > MAX_SESSIONS:
            largest = max(self._by_org.values(), key=len)
            self._close(next(iter(largest)))
        return session_id

    def _close(self, session_id: str) -> None:
        org = self._org_of.pop(session_id)
        sessions = self._by_org[org]
        sessions.pop(session_id).ended.set()
        if not sessions:
            del self._by_org[org]


__all__ = ["Viewer", "Sessions", "COOKIE", "MAX_ORG_SESSIONS", "MAX_SESSIONS", "COOKIE_PATH", "CONSOLE_ACTIONS", "AuthError",
           "ScopeError"]
