"""A DSN as people may read it: `host:port/database`, never its password.

One function, `describe_dsn`, for both DSN forms (URL and key=value); a malformed URL is
described as such rather than quoted (it may hold a password). `engine.tenant` re-exports it.
"""

from __future__ import annotations

import urllib.parse


def describe_dsn(dsn: str) -> str:
    """`host:port/database` of a DSN (URL or key=value form), never its password."""
    host = port = database = None
    if "://" in dsn:
        try:
            url = urllib.parse.urlsplit(dsn)
        except ValueError:
            return "a malformed DSN"
        query = urllib.parse.parse_qs(url.query)
        host = url.hostname or (query.get("host") or [None])[0]
        try:
            port = url.port
        except ValueError:
            port = None
        port = port or (query.get("port") or [None])[0]
        database = url.path.lstrip("/") or None
    else:
        fields = dict(
            part.split("=", 1) for part in dsn.split() if "=" in part
        )
        host, port, database = fields.get("host"), fields.get("port"), fields.get("dbname")
    where = host or "localhost"
    if port:
        where += f":{port}"
    if database:
        where += f"/{database}"
    return where
