"""The console's login routes: the login page and its form token, the one-time link, the
gateway-token login and logout.

How it works
- `GET /ui/login` shows the login page; with token login (`runplane serve`) its form carries the
  login-form cookie's token, which a GET sets when the browser has none (an answer to a POST
  sets no cookie). `GET /ui/login?once=CODE` redeems a one-time link (`runplane console`) and
  is not origin-checked: it is a link opened from a terminal.
- `POST /ui/login` reads a form of at most `MAX_LOGIN_BYTES` (larger bodies are never read) and
  is refused (403) unless it came from the console's own login page (`origin.login_allowed`:
  same-origin `Origin` / `Sec-Fetch-Site`, or the form's token); a bad token is a 401, a token
  whose actions do not include the console's reads a 403.
- A login sets the session cookie (`auth.COOKIE`: HttpOnly, SameSite=Strict, `Secure` when the
  browser reached the console over https, `origin.https`, which believes `X-Forwarded-Proto`
  only from the proxies in `Console.forwarding`) and drops the login-form cookie; `POST /ui/logout`
  ends the session and drops its cookie.
Only `routes` mounts these; nothing here reads the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from ..errors import AuthError, ScopeError
from . import origin, pages
from .auth import COOKIE, COOKIE_PATH

if TYPE_CHECKING:
    from .routes import Console

MAX_LOGIN_BYTES = 16 * 1024  # a login form holds one token; larger bodies are never read


def seen_as(request: Request) -> tuple[str, str | None, Headers]:
    """What `origin` judges a request by: its scheme, its peer's address and its headers."""
    peer = request.client.host if request.client else None
    return request.url.scheme, peer, request.headers


@attrs.frozen
class LoginRoutes:
    """The login handlers of one console (its sessions, whether gateway tokens log in, the
    proxies it believes, read on every request)."""

    console: Console

    def login_page(self, request: Request, message: str | None = None,
                   status: int = 200) -> Response:
        """The login page; with token login, its form token: the login-form cookie's, which a
        GET sets when the browser has none (an answer to a POST sets no cookie)."""
        if not self.console.token_login:
            return HTMLResponse(pages.login_page(token_login=False, message=message), status)
        token = request.cookies.get(origin.LOGIN_COOKIE) or ""
        fresh = not origin.is_form_token(token) and request.method == "GET"
        if fresh:
            token = origin.new_form_token()
        response = HTMLResponse(pages.login_page(
            token_login=True, message=message, csrf=token if origin.is_form_token(token) else ""),
            status)
        if fresh:
            response.set_cookie(origin.LOGIN_COOKIE, token, path=COOKIE_PATH, httponly=True,
                                samesite="strict",
                                secure=origin.https(self.console.forwarding, *seen_as(request)))
        return response

    async def login_form(self, request: Request) -> Response:
        code = request.query_params.get("once")
        if code is None:
            return self.login_page(request)
        try:
            session = self.console.sessions.redeem(code)
        except AuthError as exc:
            return HTMLResponse(pages.login_page(token_login=self.console.token_login,
                                                 message=str(exc)), 401)
        return self._logged_in(request, session)

    async def login(self, request: Request) -> Response:
        declared = request.headers.get("content-length", "")
        if not declared.isdigit() or int(declared) > MAX_LOGIN_BYTES:
            return HTMLResponse(pages.login_page(token_login=self.console.token_login,
                                                 message="the login form is too large"), 413)
        form = await request.form(max_files=0, max_fields=4)
        token = form.get("token")
        try:
            if not isinstance(token, str):
                raise AuthError("paste a gateway token")
            if self.console.token_login and not origin.login_allowed(
                    self.console.forwarding, *seen_as(request),
                    request.cookies.get(origin.LOGIN_COOKIE), form.get("csrf")):
                return self.login_page(request, "this login did not come from this console's "
                                       "own login page: log in here", 403)
            session = self.console.sessions.login(token)
        except AuthError as exc:
            return self.login_page(request, str(exc), 401)
        except ScopeError as exc:
            return self.login_page(request, str(exc), 403)
        return self._logged_in(request, session)

    def _logged_in(self, request: Request, session: str) -> Response:
        response = RedirectResponse("/ui/", status_code=303)
        response.set_cookie(COOKIE, session, path=COOKIE_PATH, httponly=True, samesite="strict",
                            secure=origin.https(self.console.forwarding, *seen_as(request)))
        if origin.LOGIN_COOKIE in request.cookies:  # the login form's token has done its work
            response.delete_cookie(origin.LOGIN_COOKIE, path=COOKIE_PATH, httponly=True,
                                   samesite="strict")
        return response

    async def logout(self, request: Request) -> Response:
        self.console.sessions.logout(request.cookies.get(COOKIE))
        response = RedirectResponse("/ui/login", status_code=303)
        response.delete_cookie(COOKIE, path=COOKIE_PATH, httponly=True, samesite="strict")
        return response
