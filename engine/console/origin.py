"""Where a console request comes from: its own origin (behind a trusted proxy, the proxy's),
whether a login was posted from the console's own page, and whether its cookie is Secure.
Pure: a function of the request's scope and headers, no I/O.

How it works
- `Forwarding(allow)` names the proxies trusted to say how the browser reached the console
  (`runplane serve --forwarded-allow HOST`; `*` trusts every peer). Only a request whose TCP
  peer is one of them has its `X-Forwarded-Proto` and `X-Forwarded-Host` honoured (the first
  value of each, as the nearest proxy set it); from any other peer they are ignored.
- `own_origin` is `scheme://host` of the request as the browser sees it: the server's scheme
  (https under TLS) and `Host` header, or the trusted proxy's. Default ports are left out, as
  browsers leave them out of `Origin`.
- `login_allowed` (a `POST /ui/login`): refused when `Sec-Fetch-Site` says cross-site or
  same-site, or when an `Origin` header names another origin; allowed when `Origin` is the
  console's own, or `Sec-Fetch-Site: same-origin`, or, lacking both, when the
  form's `csrf` field equals the login-form cookie that `GET /ui/login` set in this browser
  (SameSite=Strict and HttpOnly: a page elsewhere can neither send it nor read it). A form
  token fetched by an attacker is bound to the attacker's cookie, not the victim's.
  `Origin: null` tells nothing (Chromium sends it for a form posted from a page whose
  Referrer-Policy is `no-referrer`, as the console's pages are; a sandboxed frame sends it
  too), so the other two proofs decide.
- `https(...)`: a cookie set on this answer gets `Secure` when the browser reached the
  console over https (TLS here, or a trusted proxy's `X-Forwarded-Proto: https`).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Mapping

import attrs

LOGIN_COOKIE = "runplane_login"
SAME_ORIGIN = "same-origin"
DEFAULT_PORTS = {"http": ":80", "https": ":443"}


def new_form_token() -> str:
    return secrets.token_urlsafe(32)


def is_form_token(value: object) -> bool:
    """Whether `value` has the shape `new_form_token` makes (43 URL-safe characters)."""
    return (isinstance(value, str) and len(value) == 43
            and value.replace("-", "").replace("_", "").isalnum() and value.isascii())


@attrs.frozen
class Forwarding:
    """The peers whose `X-Forwarded-Proto` / `X-Forwarded-Host` are believed."""

    allow: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    def trusts(self, peer: str | None) -> bool:
        return bool(self.allow) and ("*" in self.allow or (peer is not None and peer in self.allow))


def _first(value: str | None) -> str:
    return (value or "").split(",")[0].strip()


def _without_default_port(scheme: str, host: str) -> str:
    port = DEFAULT_PORTS.get(scheme)
    return host[: -len(port)] if port and host.endswith(port) else host


def seen_as(forwarding: Forwarding, scheme: str, peer: str | None,
            headers: Mapping[str, str]) -> tuple[str, str]:
    """(scheme, host) of the request as the browser reached it."""
    host = headers.get("host", "")
    if forwarding.trusts(peer):
        proto = _first(headers.get("x-forwarded-proto")).lower()
        if proto in DEFAULT_PORTS:
            scheme = proto
        host = _first(headers.get("x-forwarded-host")) or host
    return scheme, _without_default_port(scheme, host.lower())


def own_origin(forwarding: Forwarding, scheme: str, peer: str | None,
               headers: Mapping[str, str]) -> str:
    scheme, host = seen_as(forwarding, scheme, peer, headers)
    return f"{scheme}://{host}"


def login_allowed(forwarding: Forwarding, scheme: str, peer: str | None,
                  headers: Mapping[str, str], cookie: str | None, field: object) -> bool:
    """Whether a `POST /ui/login` came from the console's own page (see the module docstring)."""
    site = headers.get("sec-fetch-site")
    if site is not None and site.strip().lower() not in (SAME_ORIGIN, "none"):
        return False
    origin = headers.get("origin")
    if origin is not None and origin.strip().lower() != "null":
        scheme_of, _, host = origin.strip().lower().partition("://")
        given = f"{scheme_of}://{_without_default_port(scheme_of, host)}"
        return hmac.compare_digest(given.encode(), own_origin(forwarding, scheme, peer,
                                                              headers).encode())
    if site is not None and site.strip().lower() == SAME_ORIGIN:
        return True
    return (is_form_token(field) and is_form_token(cookie)
            and hmac.compare_digest(str(field).encode(), str(cookie).encode()))


def https(forwarding: Forwarding, scheme: str, peer: str | None,
          headers: Mapping[str, str]) -> bool:
    """Whether the browser reached the console over https: a cookie set now gets `Secure`."""
    return seen_as(forwarding, scheme, peer, headers)[0] == "https"
