"""A database session's credentials: the password's SCRAM-SHA-256 verifier (what PostgreSQL
stores, so the plain password never reaches the server) and the session URL a runner connects
with (the tenant's DSN with the session's user and password, keeping only where the server is
and how to reach it over TLS). Pure: no I/O. Who calls: `sessions.minting`, and callers that
build a session's URL from a minted session.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import urllib.parse

from ..errors import InvalidInputError

SCRAM_ITERATIONS = 4096


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for `password` (RFC 5802 / 7677)."""
    salt = os.urandom(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = lambda raw: base64.b64encode(raw).decode("ascii")  # noqa: E731
    return (f"SCRAM-SHA-256${iterations}:{b64(salt)}"
            f"${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}")


# What a session URL keeps of the gateway's DSN: where the server is and how to reach it over
# TLS. Everything else (sslpassword, passfile, options, client certificates, ...) belongs to the
# gateway's own login and never travels to a runner.
URL_PARAMETERS = frozenset({"host", "hostaddr", "port", "dbname", "sslmode", "sslrootcert",
                            "sslnegotiation", "sslcrl", "target_session_attrs"})


def session_url(dsn: str, user: str, password: str | None) -> str:
    """`dsn` (a postgresql:// URL) with its user and password replaced, keeping only its hosts,
    ports, database and TLS mode (`URL_PARAMETERS`). `password=None` leaves the password out."""
    if "://" not in dsn:
        raise InvalidInputError("database sessions need a postgresql:// URL DSN")
    url = urllib.parse.urlsplit(dsn)
    host = url.netloc.rpartition("@")[2]
    userinfo = urllib.parse.quote(user, safe="")
    if password is not None:
        userinfo += ":" + urllib.parse.quote(password, safe="")
    query = [(k, v) for k, v in urllib.parse.parse_qsl(url.query, keep_blank_values=True)
             if k in URL_PARAMETERS]
    return urllib.parse.urlunsplit(
        url._replace(netloc=f"{userinfo}@{host}", query=urllib.parse.urlencode(query), fragment="")
    )
