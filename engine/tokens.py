"""Gateway tokens: HS256 JWTs scoped to one org, some plays and some actions.

How it works
- `mint_token(secret, org, plays=("*",), actions=("*",), ttl_s=3600, runs=None)` signs the
  claims `org`, `plays`, `actions`, `exp`, `iat` and a random `jti` with the gateway's secret
  (PyJWT); with `runs`, also a `runs` claim listing the run ids the token may name.
- `verify_token(secret, token)` checks signature, expiry and the claims' shapes and returns
  `TokenClaims`, or raises `AuthError` (HTTP 401). Messages never contain the token.
  `VerifiedTokens` (the server's) remembers the tokens it verified, checking only expiry on a
  repeat.
- Clock skew: a token minted on a host whose clock runs ahead carries `iat` (and maybe `nbf`)
  in our future. Both are accepted up to a leeway ahead of our clock (`leeway_s`; default
  `RUNPLANE_TOKEN_LEEWAY_S` from the environment, else `DEFAULT_LEEWAY_S`). `exp` never gets
  a leeway: a token is expired once our clock reaches its `exp`.
- `TokenClaims.check_action(action)` and `check_target(action, org, play)` raise `ScopeError`
  (HTTP 403) naming the claim that does not allow the request. `plays` and `actions` hold
  exact names, `"*"` (anything), or for actions a family such as `"receipts.*"`. An action
  whose input names no play (an org-wide outbox step such as `outbox.claim_due`) needs `plays`
  to allow every play (`"*"`).
- `TokenClaims.check_run(action, run_id)` raises `ScopeError` when the token has a `runs` claim
  that does not list `run_id`. A token without that claim allows every run; an action whose
  input names no run is not checked against it.
The server verifies and checks before it reads the request body or runs any query.
Who calls: the gateway (`engine.gateway`: the server verifies, the client reads its own
token's org and plays, the session router checks `allows`) and the console's login
(`engine.console.auth`); both sit above this module, which imports neither.
This module does no I/O.
"""

from __future__ import annotations

import math
import os
import time
import uuid
from typing import Iterable

import attrs
import jwt

from .limits.bounds import is_number
from .errors import AuthError, InvalidInputError, ScopeError

ALGORITHM = "HS256"
REQUIRED_CLAIMS = ("org", "plays", "actions", "exp", "iat", "jti")
LEEWAY_ENV = "RUNPLANE_TOKEN_LEEWAY_S"
DEFAULT_LEEWAY_S = 30.0
MAX_LEEWAY_S = 3600.0


def token_leeway_s(value: object = None) -> float:
    """The clock-skew leeway for `iat`/`nbf`: `value` when given, else `RUNPLANE_TOKEN_LEEWAY_S`
    from the environment, else `DEFAULT_LEEWAY_S`; `InvalidInputError` naming where it came
    from unless it is a number of seconds from 0 to `MAX_LEEWAY_S`."""
    where = "leeway_s"
    if value is None:
        text = os.environ.get(LEEWAY_ENV, "").strip()
        if not text:
            return DEFAULT_LEEWAY_S
        where = LEEWAY_ENV
        try:
            value = float(text)
        except ValueError:
            raise InvalidInputError(f"{LEEWAY_ENV} must be a number of seconds, got {text!r}") from None
    if not is_number(value, 0, MAX_LEEWAY_S):
        raise InvalidInputError(f"{where} must be a number of seconds from 0 to {MAX_LEEWAY_S:g}, "
                                f"got {value!r}")
    return float(value)


def _names(value: object, claim: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidInputError(f"{claim} must be a list of names")
    names = tuple(value)
    if not names or not all(isinstance(name, str) and name.strip() for name in names):
        raise InvalidInputError(f"{claim} must be a non-empty list of non-empty names")
    return names


def mint_token(secret: str, org: str, *, plays: Iterable[str] = ("*",),
               actions: Iterable[str] = ("*",), ttl_s: float = 3600,
               runs: Iterable[str] | None = None) -> str:
    """A token for `org`, allowing `plays` and `actions` (and only the run ids in `runs`, when
    given), valid for `ttl_s` seconds."""
    if not isinstance(secret, str) or not secret:
        raise InvalidInputError("the gateway secret must be a non-empty string")
    if not isinstance(org, str) or not org.strip():
        raise InvalidInputError("org must be a non-empty string")
    if not is_number(ttl_s, above=0, below=math.inf):
        raise InvalidInputError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    now = int(time.time())
    claims = {
        "org": org.strip(), "plays": list(_names(plays, "plays")),
        "actions": list(_names(actions, "actions")), "iat": now,
        "exp": now + max(1, int(math.ceil(ttl_s))), "jti": uuid.uuid4().hex,
    }
    if runs is not None:
        claims["runs"] = list(_names(runs, "runs"))
    return jwt.encode(claims, secret, algorithm=ALGORITHM)


def allows(patterns: tuple[str, ...], name: str) -> bool:
    """Whether a claim's names (exact, `*`, or a family `x.*`) allow `name`."""
    for pattern in patterns:
        if pattern == "*" or pattern == name:
            return True
        if pattern.endswith(".*") and name.startswith(pattern[:-1]):
            return True
    return False


@attrs.frozen
class TokenClaims:
    """The verified claims of a token."""

    org: str
    plays: tuple[str, ...]
    actions: tuple[str, ...]
    exp: int
    iat: int
    jti: str
    runs: tuple[str, ...] | None = None  # None: every run

    def check_action(self, action: str) -> None:
        """Raise `ScopeError` unless the `actions` claim allows `action`."""
        if not allows(self.actions, action):
            raise ScopeError(f"the token's actions claim does not allow {action}")

    def check_target(self, action: str, org: str | None, play: str | None) -> None:
        """Raise `ScopeError` naming the claim (`org` or `plays`) that does not allow the
        org and play an action's input names (None, None: an org-wide action)."""
        if org is not None and org != self.org:
            raise ScopeError(f"the token's org claim does not allow org {org!r}")
        if play is None:
            if "*" not in self.plays:
                raise ScopeError(f"the token's plays claim must allow every play for {action}")
        elif "*" not in self.plays and play not in self.plays:
            raise ScopeError(f"the token's plays claim does not allow play {play!r}")

    def check_run(self, action: str, run_id: str) -> None:
        """Raise `ScopeError` unless the `runs` claim (when the token has one) lists `run_id`."""
        if self.runs is not None and run_id not in self.runs:
            raise ScopeError(f"the token's runs claim does not allow run {run_id!r} for {action}")


def verify_token(secret: str, token: str | None, *, leeway_s: float | None = None) -> TokenClaims:
    """The token's claims, or `AuthError` when it is missing, invalid or expired; `iat` and
    `nbf` may be up to `leeway_s` ahead of our clock (see the module docstring), `exp` not."""
    if not token:
        raise AuthError("missing bearer token (Authorization: Bearer TOKEN)")
    leeway = token_leeway_s(leeway_s)
    try:  # PyJWT's leeway would also extend `exp`: expiry is checked below, without one
        claims = jwt.decode(token, secret, algorithms=[ALGORITHM], leeway=leeway,
                            options={"require": list(REQUIRED_CLAIMS), "verify_exp": False})
    except jwt.InvalidTokenError as exc:
        raise AuthError(f"invalid token: {type(exc).__name__}") from None
    try:
        if not isinstance(claims["org"], str) or not claims["org"]:
            raise InvalidInputError("org")
        runs = claims.get("runs")
        verified = TokenClaims(claims["org"], _names(claims["plays"], "plays"),
                               _names(claims["actions"], "actions"), _timestamp(claims["exp"]),
                               _timestamp(claims["iat"]), str(claims["jti"]),
                               None if runs is None else _names(runs, "runs"))
    except (InvalidInputError, TypeError, ValueError, OverflowError):
        raise AuthError("invalid token: malformed claims") from None
    if verified.exp <= time.time():
        raise AuthError("the token has expired")
    return verified


def _timestamp(value: object) -> int:
    """A NumericDate claim as whole seconds (`TypeError` for anything but a finite number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError("a time claim must be a number")
    return int(value)


@attrs.define(eq=False)
class VerifiedTokens:
    """`verify_token` with the tokens one secret already verified remembered (at most
    `capacity`, least recently used dropped): a client sends the same token on every request,
    and its signature and claims cannot change, so a repeat costs a lookup and an expiry check
    (an expired token is verified again, which refuses it). Only verified tokens are kept."""

    secret: str = attrs.field(repr=False)
    capacity: int = 1024
    leeway_s: float = attrs.field(default=None, converter=token_leeway_s)  # read once, at start
    _known: dict[str, TokenClaims] = attrs.field(init=False, factory=dict, repr=False)

    def verify(self, token: str | None) -> TokenClaims:
        claims = self._known.pop(token, None) if token else None
        if claims is None or claims.exp <= time.time():
            claims = verify_token(self.secret, token, leeway_s=self.leeway_s)
            if len(self._known) >= self.capacity:
                del self._known[next(iter(self._known))]
        assert token is not None
        self._known[token] = claims  # (re)inserted last: the most recently used
        return claims


def _unverified_names(token: str, claim: str) -> tuple[str, ...] | None:
    """A list claim's names, read without checking the token's signature; None for `*` (every
    name) or a token that cannot be read (the gateway's answer will say why)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError:
        return None
    names = claims.get(claim)
    if not isinstance(names, list) or "*" in names or not all(isinstance(n, str) for n in names):
        return None
    return tuple(names)


def unverified_plays(token: str) -> tuple[str, ...] | None:
    """The plays a token allows, read unverified; None for every play."""
    return _unverified_names(token, "plays")


def unverified_actions(token: str) -> tuple[str, ...] | None:
    """The `actions` claim's names, read unverified (a client skips an optional action its
    token cannot send); None for every action."""
    return _unverified_names(token, "actions")


def unverified_org(token: str) -> str:
    """The org a token names, read without checking its signature (a client learns its org this
    way; the gateway verifies every request)."""
    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except jwt.InvalidTokenError:
        raise AuthError("the token is not a JWT") from None
    org = claims.get("org")
    if not isinstance(org, str) or not org.strip():
        raise AuthError("the token names no org")
    return org
